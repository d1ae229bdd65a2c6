//! The everyday items, for `use wrk_sdk::prelude::*;`.

pub use crate::JoinType;
pub use crate::aggregate::{Agg, count, count_distinct, max, mean, min, sum};
pub use crate::column::Column;
pub use crate::context;
pub use crate::error::{Error, ErrorCode, Result};
pub use crate::expr::{Expr, col, if_else, lit, when};
pub use crate::io::{read_parquet, write_parquet};
pub use crate::memory;
pub use crate::order::{SortKey, asc, desc};
pub use crate::shuffle;
pub use crate::table::Table;
pub use crate::task::Task;
pub use crate::types::{DataType, Field, Scalar};
pub use crate::{debug, error, info, trace, warn};
