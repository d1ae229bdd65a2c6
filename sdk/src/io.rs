//! Parquet input and output, limited to the sources and sinks the job granted by name.

use crate::bindings::wrk::task::io as raw;
use crate::error::Result;
use crate::expr::Expr;
use crate::table::Table;

/// Names of the sources this task may read.
pub fn sources() -> Vec<String> {
    raw::sources()
}

/// Names of the sinks this task may write.
pub fn sinks() -> Vec<String> {
    raw::sinks()
}

/// Starts reading Parquet from the granted source `source`; finish with [`ReadParquet::read`].
pub fn read_parquet(source: &str) -> ReadParquet {
    ReadParquet {
        source: source.to_owned(),
        columns: None,
        row_groups: None,
        predicate: None,
    }
}

/// A Parquet read being set up; see [`read_parquet`].
#[derive(Debug, Clone)]
#[must_use = "nothing is read until `.read()`"]
pub struct ReadParquet {
    source: String,
    columns: Option<Vec<String>>,
    row_groups: Option<Vec<u32>>,
    predicate: Option<Expr>,
}

impl ReadParquet {
    /// Reads only these columns (by default every column).
    pub fn columns<S: Into<String>>(self, columns: impl IntoIterator<Item = S>) -> Self {
        Self {
            columns: Some(columns.into_iter().map(Into::into).collect()),
            ..self
        }
    }

    /// Reads only these row groups, counted across the source's files in path order (by
    /// default every row group).
    pub fn row_groups(self, row_groups: impl IntoIterator<Item = u32>) -> Self {
        Self {
            row_groups: Some(row_groups.into_iter().collect()),
            ..self
        }
    }

    /// Reads only the rows where `predicate` is true; row groups whose statistics rule it out
    /// are skipped without being read (predicate pushdown). The predicate may use columns that
    /// [`ReadParquet::columns`] leaves out.
    pub fn filter(self, predicate: impl Into<Expr>) -> Self {
        Self {
            predicate: Some(predicate.into()),
            ..self
        }
    }

    /// Reads the data into a host table.
    pub fn read(self) -> Result<Table> {
        let options = raw::ReadOptions {
            columns: self.columns,
            row_groups: self.row_groups,
        };
        let raw = match &self.predicate {
            Some(predicate) => raw::read_parquet_where(&self.source, &options, predicate.as_raw())?,
            None => raw::read_parquet(&self.source, &options)?,
        };
        Ok(Table::from_raw(raw))
    }
}

/// Writes `table` as one Parquet object under the granted sink `sink`; returns the object's
/// name, which is unique to this task and `name`.
pub fn write_parquet(sink: &str, name: &str, table: &Table) -> Result<String> {
    Ok(raw::write_parquet(sink, name, table.as_raw())?)
}
