//! Predicate pushdown into Parquet: decides from a row group's column statistics (min, max,
//! null count) whether any of its rows can satisfy a filter expression, so that row groups that
//! cannot are never read.
//!
//! The decision is conservative: anything it does not understand (a computed operand, an
//! unsigned column, missing statistics) may match. Float columns never prune on `>`, `>=` or
//! `!=`, because statistics leave NaN out and NaN sorts above every number in our comparisons.

use arrow::datatypes::{DataType, Schema};
use parquet::file::metadata::RowGroupMetaData;
use parquet::file::statistics::Statistics;

use crate::expr::{Expr, Literal};
use crate::guest_api::wit::{BinaryOp, UnaryOp};

/// One bound of a column's values, comparable with a literal.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
enum Bound {
    Int(i64),
    Float(f64),
    Bytes(Vec<u8>),
    Bool(bool),
}

/// A column chunk's statistics.
struct ColumnStats {
    min: Option<Bound>,
    max: Option<Bound>,
    nulls: Option<u64>,
    rows: u64,
    float: bool,
}

/// Whether some row of `group` may satisfy `predicate` (`schema` is the file's Arrow schema,
/// whose top-level columns map one to one onto the group's column chunks).
pub fn may_match(predicate: &Expr, schema: &Schema, group: &RowGroupMetaData) -> bool {
    let stats = |name: &str| column_stats(schema, group, name);
    maybe(predicate, &stats)
}

fn column_stats(schema: &Schema, group: &RowGroupMetaData, name: &str) -> Option<ColumnStats> {
    let index = schema.index_of(name).ok()?;
    let data_type = schema.field(index).data_type();
    // Flat schemas only: one leaf per top-level column.
    if group.num_columns() != schema.fields().len() {
        return None;
    }
    let stats = group.column(index).statistics()?;
    let signed_or_float = data_type.is_signed_integer()
        || data_type.is_floating()
        || matches!(data_type, DataType::Utf8 | DataType::Boolean);
    if !signed_or_float {
        return None;
    }
    let (min, max) = match stats {
        Statistics::Boolean(s) => (
            s.min_opt().map(|v| Bound::Bool(*v)),
            s.max_opt().map(|v| Bound::Bool(*v)),
        ),
        Statistics::Int32(s) => (
            s.min_opt().map(|v| Bound::Int(i64::from(*v))),
            s.max_opt().map(|v| Bound::Int(i64::from(*v))),
        ),
        Statistics::Int64(s) => (
            s.min_opt().map(|v| Bound::Int(*v)),
            s.max_opt().map(|v| Bound::Int(*v)),
        ),
        Statistics::Float(s) => (
            s.min_opt().map(|v| Bound::Float(f64::from(*v))),
            s.max_opt().map(|v| Bound::Float(f64::from(*v))),
        ),
        Statistics::Double(s) => (
            s.min_opt().map(|v| Bound::Float(*v)),
            s.max_opt().map(|v| Bound::Float(*v)),
        ),
        Statistics::ByteArray(s)
            if *data_type == DataType::Utf8 && s.min_is_exact() && s.max_is_exact() =>
        {
            (
                s.min_opt().map(|v| Bound::Bytes(v.data().to_vec())),
                s.max_opt().map(|v| Bound::Bytes(v.data().to_vec())),
            )
        }
        _ => return None,
    };
    Some(ColumnStats {
        min,
        max,
        nulls: stats.null_count_opt(),
        rows: group.num_rows().max(0) as u64,
        float: data_type.is_floating(),
    })
}

fn maybe(expr: &Expr, stats: &dyn Fn(&str) -> Option<ColumnStats>) -> bool {
    match expr {
        Expr::Binary {
            op: BinaryOp::And,
            lhs,
            rhs,
        } => maybe(lhs, stats) && maybe(rhs, stats),
        Expr::Binary {
            op: BinaryOp::Or,
            lhs,
            rhs,
        } => maybe(lhs, stats) || maybe(rhs, stats),
        Expr::Binary { op, lhs, rhs } => match (lhs.as_ref(), rhs.as_ref()) {
            (Expr::Column(name), Expr::Literal(value)) => compare(*op, stats(name), value),
            (Expr::Literal(value), Expr::Column(name)) => match flipped(*op) {
                Some(op) => compare(op, stats(name), value),
                None => true,
            },
            _ => true,
        },
        Expr::Unary { op, arg } => match (op, arg.as_ref()) {
            (UnaryOp::IsNull, Expr::Column(name)) => {
                stats(name).and_then(|s| s.nulls).is_none_or(|n| n > 0)
            }
            (UnaryOp::IsNotNull, Expr::Column(name)) => stats(name)
                .and_then(|s| s.nulls.map(|n| n < s.rows))
                .unwrap_or(true),
            _ => true,
        },
        Expr::Literal(Literal::Boolean(false) | Literal::Null) => false,
        _ => true,
    }
}

/// `literal op column` as `column op' literal`.
fn flipped(op: BinaryOp) -> Option<BinaryOp> {
    use BinaryOp::*;
    Some(match op {
        Eq => Eq,
        Ne => Ne,
        Lt => Gt,
        Le => Ge,
        Gt => Lt,
        Ge => Le,
        _ => return None,
    })
}

/// Whether some value in `[min, max]` may satisfy `column op literal`.
fn compare(op: BinaryOp, stats: Option<ColumnStats>, literal: &Literal) -> bool {
    use BinaryOp::*;
    let Some(stats) = stats else {
        return true;
    };
    let (Some(min), Some(max)) = (&stats.min, &stats.max) else {
        return true;
    };
    // Every value null: no comparison is true.
    if stats.nulls == Some(stats.rows) {
        return false;
    }
    let value = match (literal, min) {
        (Literal::Int64(v), Bound::Int(_)) => Bound::Int(*v),
        (Literal::Int64(v), Bound::Float(_)) => Bound::Float(*v as f64),
        (Literal::Float64(v), Bound::Float(_)) if !v.is_nan() && *v != 0.0 => Bound::Float(*v),
        (Literal::Utf8(v), Bound::Bytes(_)) => Bound::Bytes(v.as_bytes().to_vec()),
        (Literal::Boolean(v), Bound::Bool(_)) => Bound::Bool(*v),
        _ => return true,
    };
    if stats.float && matches!(value, Bound::Float(v) if v == 0.0) {
        return true;
    }
    let ordered = |a: &Bound, b: &Bound| a.partial_cmp(b);
    use std::cmp::Ordering::*;
    match op {
        Eq => ordered(&value, min) != Some(Less) && ordered(&value, max) != Some(Greater),
        Ne => stats.float || !(min == max && *min == value),
        Lt => ordered(min, &value) == Some(Less),
        Le => ordered(min, &value) != Some(Greater),
        Gt => stats.float || ordered(max, &value) == Some(Greater),
        Ge => stats.float || ordered(max, &value) != Some(Less),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn stats(min: Bound, max: Bound, float: bool) -> impl Fn(&str) -> Option<ColumnStats> {
        move |name: &str| {
            (name == "x").then(|| ColumnStats {
                min: Some(min.clone()),
                max: Some(max.clone()),
                nulls: Some(0),
                rows: 100,
                float,
            })
        }
    }

    fn cmp(op: BinaryOp, value: Literal) -> Expr {
        Expr::Binary {
            op,
            lhs: Arc::new(Expr::col("x")),
            rhs: Arc::new(Expr::Literal(value)),
        }
    }

    #[test]
    fn integer_ranges_prune_every_comparison() {
        let s = stats(Bound::Int(10), Bound::Int(20), false);
        use BinaryOp::*;
        assert!(!maybe(&cmp(Lt, Literal::Int64(10)), &s));
        assert!(maybe(&cmp(Le, Literal::Int64(10)), &s));
        assert!(!maybe(&cmp(Gt, Literal::Int64(20)), &s));
        assert!(maybe(&cmp(Ge, Literal::Int64(20)), &s));
        assert!(!maybe(&cmp(Eq, Literal::Int64(21)), &s));
        assert!(maybe(&cmp(Eq, Literal::Int64(15)), &s));
        let both = Expr::Binary {
            op: And,
            lhs: Arc::new(cmp(Gt, Literal::Int64(5))),
            rhs: Arc::new(cmp(Lt, Literal::Int64(8))),
        };
        assert!(!maybe(&both, &s));
        let either = Expr::Binary {
            op: Or,
            lhs: Arc::new(cmp(Gt, Literal::Int64(5))),
            rhs: Arc::new(cmp(Lt, Literal::Int64(8))),
        };
        assert!(maybe(&either, &s));
        let flipped = Expr::Binary {
            op: Lt,
            lhs: Arc::new(Expr::Literal(Literal::Int64(20))),
            rhs: Arc::new(Expr::col("x")),
        };
        assert!(!maybe(&flipped, &s), "20 < x cannot hold when x <= 20");
    }

    #[test]
    fn floats_never_prune_upwards_because_nan_sorts_last() {
        let s = stats(Bound::Float(1.0), Bound::Float(2.0), true);
        assert!(!maybe(&cmp(BinaryOp::Lt, Literal::Float64(1.0)), &s));
        assert!(maybe(&cmp(BinaryOp::Gt, Literal::Float64(5.0)), &s));
        assert!(
            maybe(&cmp(BinaryOp::Lt, Literal::Float64(0.0)), &s),
            "zero's sign is unknown"
        );
    }

    #[test]
    fn unknown_columns_and_computed_operands_may_match() {
        let s = stats(Bound::Int(10), Bound::Int(20), false);
        let other = Expr::Binary {
            op: BinaryOp::Lt,
            lhs: Arc::new(Expr::col("y")),
            rhs: Arc::new(Expr::Literal(Literal::Int64(0))),
        };
        assert!(maybe(&other, &s));
    }
}
