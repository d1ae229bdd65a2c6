//! Tables held by the host, and the operators that run on them natively.

use crate::aggregate::Agg;
use crate::bindings::wrk::task::dataframe::{Expr as RawExpr, JoinType, Table as RawTable};
use crate::column::Column;
use crate::error::Result;
use crate::expr::Expr;
use crate::order::SortKey;
use crate::types::Field;

/// A handle to a table held by the host. Operators return new tables; none copies data into
/// the guest except [`Table::to_ipc`] (and [`Column::to_values`] on its columns).
#[derive(Debug)]
pub struct Table(RawTable);

impl Table {
    /// Wraps a raw table handle.
    pub fn from_raw(raw: RawTable) -> Self {
        Self(raw)
    }

    /// The raw table handle.
    pub fn as_raw(&self) -> &RawTable {
        &self.0
    }

    /// Unwraps the raw table handle.
    pub fn into_raw(self) -> RawTable {
        self.0
    }

    /// A table made of columns of equal length, in order.
    pub fn from_columns<'a>(columns: impl IntoIterator<Item = &'a Column>) -> Result<Table> {
        let columns: Vec<_> = columns.into_iter().map(Column::as_raw).collect();
        Ok(Table(RawTable::from_columns(&columns)?))
    }

    /// Concatenates tables with the same schema.
    pub fn concat<'a>(tables: impl IntoIterator<Item = &'a Table>) -> Result<Table> {
        let tables: Vec<_> = tables.into_iter().map(Table::as_raw).collect();
        Ok(Table(RawTable::concat(&tables)?))
    }

    /// Decodes an Arrow IPC stream made by the guest (a copy counted in the task's statistics).
    pub fn from_ipc(bytes: &[u8]) -> Result<Table> {
        Ok(Table(RawTable::from_ipc(bytes)?))
    }

    /// Encodes the table as an Arrow IPC stream in the guest (a copy counted in the task's
    /// statistics).
    pub fn to_ipc(&self) -> Result<Vec<u8>> {
        Ok(self.0.to_ipc()?)
    }

    /// The table's fields, in column order.
    pub fn schema(&self) -> Vec<Field> {
        self.0.schema()
    }

    /// The number of rows.
    pub fn num_rows(&self) -> u64 {
        self.0.num_rows()
    }

    /// The column named `name`.
    pub fn column(&self, name: &str) -> Result<Column> {
        Ok(Column::from_raw(self.0.column(name)?))
    }

    /// The named columns, in the order given.
    pub fn select<S: AsRef<str>>(&self, columns: impl IntoIterator<Item = S>) -> Result<Table> {
        Ok(Table(self.0.select(&strings(columns))?))
    }

    /// The rows where `predicate`, a boolean expression, is true.
    pub fn filter(&self, predicate: impl Into<Expr>) -> Result<Table> {
        Ok(Table(self.0.filter(predicate.into().as_raw())?))
    }

    /// This table with the column `name` added, or replaced, with the values of `value`.
    pub fn with_column(&self, name: &str, value: impl Into<Expr>) -> Result<Table> {
        self.with_columns([(name, value)])
    }

    /// This table with several columns added or replaced, all evaluated in one pass over this
    /// table (a new column cannot refer to another one of the same call).
    pub fn with_columns<N, E>(&self, columns: impl IntoIterator<Item = (N, E)>) -> Result<Table>
    where
        N: Into<String>,
        E: Into<Expr>,
    {
        let (names, values): (Vec<String>, Vec<Expr>) = columns
            .into_iter()
            .map(|(name, value)| (name.into(), value.into()))
            .unzip();
        let values: Vec<&RawExpr> = values.iter().map(Expr::as_raw).collect();
        Ok(Table(self.0.with_columns(&names, &values)?))
    }

    /// Evaluates an expression to a column of this table's length.
    pub fn evaluate(&self, value: impl Into<Expr>) -> Result<Column> {
        Ok(Column::from_raw(self.0.evaluate(value.into().as_raw())?))
    }

    /// Groups the rows by the key columns; finish with [`GroupBy::agg`].
    pub fn group_by<S: AsRef<str>>(&self, keys: impl IntoIterator<Item = S>) -> GroupBy<'_> {
        GroupBy {
            table: self,
            keys: strings(keys),
        }
    }

    /// One row: the aggregates over the whole table (`sum("x")`, `count("x")`...), in order.
    pub fn aggregate(&self, aggregates: impl IntoIterator<Item = Agg>) -> Result<Table> {
        let aggregates: Vec<_> = aggregates.into_iter().map(|a| a.to_raw()).collect();
        Ok(Table(self.0.aggregate(&aggregates)?))
    }

    /// `length` rows from `offset` on.
    pub fn slice(&self, offset: u64, length: u64) -> Table {
        Table(self.0.slice(offset, length))
    }

    /// The first `n` rows (all of them if there are fewer).
    pub fn head(&self, n: u64) -> Table {
        Table(self.0.head(n))
    }

    /// Hash join with `right` on columns that have the same names in both tables. The result
    /// has this table's columns, then `right`'s except the keys (suffixed `_right` when a name
    /// is taken). Null keys never match.
    pub fn join<S: AsRef<str>>(
        &self,
        right: &Table,
        on: impl IntoIterator<Item = S>,
        how: JoinType,
    ) -> Result<Table> {
        let on = strings(on);
        Ok(Table(self.0.join(&right.0, &on, &on, how)?))
    }

    /// Hash join with `right` on `left_on[i] = right_on[i]`; see [`Table::join`].
    pub fn join_on<L: AsRef<str>, R: AsRef<str>>(
        &self,
        right: &Table,
        left_on: impl IntoIterator<Item = L>,
        right_on: impl IntoIterator<Item = R>,
        how: JoinType,
    ) -> Result<Table> {
        Ok(Table(self.0.join(
            &right.0,
            &strings(left_on),
            &strings(right_on),
            how,
        )?))
    }

    /// The rows ordered by `keys` (`asc("x")`, `desc("y").nulls_first()`, or plain column names
    /// for ascending); a stable sort.
    pub fn sort<K: Into<SortKey>>(&self, keys: impl IntoIterator<Item = K>) -> Result<Table> {
        Ok(Table(self.0.sort(&sort_keys(keys))?))
    }

    /// The first `k` rows in the order of `keys`, found without sorting the whole table.
    pub fn top_k<K: Into<SortKey>>(
        &self,
        keys: impl IntoIterator<Item = K>,
        k: u64,
    ) -> Result<Table> {
        Ok(Table(self.0.top_k(&sort_keys(keys), k)?))
    }

    /// The distinct rows (the first of each), in order of first occurrence.
    pub fn distinct(&self) -> Result<Table> {
        Ok(Table(self.0.distinct(None)?))
    }

    /// One row per distinct combination of `columns` (the first row of each).
    pub fn distinct_on<S: AsRef<str>>(
        &self,
        columns: impl IntoIterator<Item = S>,
    ) -> Result<Table> {
        Ok(Table(self.0.distinct(Some(&strings(columns)))?))
    }

    /// Splits the rows into `partitions` tables by a stable hash of `keys`: equal keys go to the
    /// same partition on every worker (what a shuffle sends to each reducer).
    pub fn hash_partition<S: AsRef<str>>(
        &self,
        keys: impl IntoIterator<Item = S>,
        partitions: u32,
    ) -> Result<Vec<Table>> {
        let parts = self.0.hash_partition(&strings(keys), partitions)?;
        Ok(parts.into_iter().map(Table).collect())
    }
}

fn sort_keys<K: Into<SortKey>>(
    keys: impl IntoIterator<Item = K>,
) -> Vec<crate::bindings::wrk::task::dataframe::SortKey> {
    keys.into_iter().map(|k| k.into().to_raw()).collect()
}

/// A table grouped by key columns, waiting for its aggregates; see [`Table::group_by`].
#[must_use = "a group-by does nothing until `.agg(..)`"]
pub struct GroupBy<'a> {
    table: &'a Table,
    keys: Vec<String>,
}

impl GroupBy<'_> {
    /// One row per distinct key combination: the keys, then the aggregates in order.
    pub fn agg(self, aggregates: impl IntoIterator<Item = Agg>) -> Result<Table> {
        let aggregates: Vec<_> = aggregates.into_iter().map(|a| a.to_raw()).collect();
        Ok(Table(self.table.0.group_by(&self.keys, &aggregates)?))
    }
}

fn strings<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> Vec<String> {
    items.into_iter().map(|s| s.as_ref().to_owned()).collect()
}
