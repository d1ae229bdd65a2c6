//! Sort keys for [`Table::sort`](crate::Table::sort) and [`Table::top_k`](crate::Table::top_k):
//! `asc("fare")`, `desc("distance").nulls_first()`.

use crate::bindings::wrk::task::dataframe::SortKey as RawSortKey;

/// One sort key: a column, its direction and where its nulls go (last unless asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SortKey {
    column: String,
    descending: bool,
    nulls_first: bool,
}

impl SortKey {
    /// Puts the column's nulls before every value.
    pub fn nulls_first(mut self) -> Self {
        self.nulls_first = true;
        self
    }

    /// Puts the column's nulls after every value (the default).
    pub fn nulls_last(mut self) -> Self {
        self.nulls_first = false;
        self
    }

    /// The raw WIT record.
    pub fn to_raw(&self) -> RawSortKey {
        RawSortKey {
            column: self.column.clone(),
            descending: self.descending,
            nulls_first: self.nulls_first,
        }
    }
}

/// Ascending order of `column`.
pub fn asc(column: impl Into<String>) -> SortKey {
    SortKey {
        column: column.into(),
        descending: false,
        nulls_first: false,
    }
}

/// Descending order of `column`.
pub fn desc(column: impl Into<String>) -> SortKey {
    SortKey {
        column: column.into(),
        descending: true,
        nulls_first: false,
    }
}

impl From<&str> for SortKey {
    /// A bare column name sorts ascending.
    fn from(column: &str) -> Self {
        asc(column)
    }
}
