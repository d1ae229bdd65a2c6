//! Aggregates for [`Table::group_by`](crate::Table::group_by): `sum("x").alias("total")`, ...

use crate::bindings::wrk::task::dataframe::Aggregate as RawAggregate;
pub use crate::bindings::wrk::task::dataframe::AggregateOp;

/// One aggregate of a group-by: an operation over a column, named in the result.
///
/// Without [`Agg::alias`] the result column is named `<column>_<op>`, e.g. `fare_sum` or
/// `vendor_count_distinct`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Agg {
    column: String,
    op: AggregateOp,
    alias: Option<String>,
}

impl Agg {
    /// `op` over `column`.
    pub fn new(column: impl Into<String>, op: AggregateOp) -> Self {
        Self {
            column: column.into(),
            op,
            alias: None,
        }
    }

    /// Names the result column.
    pub fn alias(self, name: impl Into<String>) -> Self {
        Self {
            alias: Some(name.into()),
            ..self
        }
    }

    /// The aggregated column.
    pub fn column(&self) -> &str {
        &self.column
    }

    /// The operation.
    pub fn op(&self) -> AggregateOp {
        self.op
    }

    /// The name of the result column: the alias, or `<column>_<op>`.
    pub fn output_name(&self) -> String {
        match &self.alias {
            Some(alias) => alias.clone(),
            None => format!("{}_{}", self.column, op_name(self.op)),
        }
    }

    /// The WIT record for this aggregate.
    pub fn to_raw(&self) -> RawAggregate {
        RawAggregate {
            column: self.column.clone(),
            op: self.op,
            alias: self.output_name(),
        }
    }
}

fn op_name(op: AggregateOp) -> &'static str {
    match op {
        AggregateOp::Sum => "sum",
        AggregateOp::Count => "count",
        AggregateOp::Mean => "mean",
        AggregateOp::Min => "min",
        AggregateOp::Max => "max",
        AggregateOp::CountDistinct => "count_distinct",
    }
}

/// Sum of the column's values.
pub fn sum(column: impl Into<String>) -> Agg {
    Agg::new(column, AggregateOp::Sum)
}

/// Number of non-null values.
pub fn count(column: impl Into<String>) -> Agg {
    Agg::new(column, AggregateOp::Count)
}

/// Arithmetic mean of the column's values.
pub fn mean(column: impl Into<String>) -> Agg {
    Agg::new(column, AggregateOp::Mean)
}

/// Smallest value.
pub fn min(column: impl Into<String>) -> Agg {
    Agg::new(column, AggregateOp::Min)
}

/// Largest value.
pub fn max(column: impl Into<String>) -> Agg {
    Agg::new(column, AggregateOp::Max)
}

/// Number of distinct values.
pub fn count_distinct(column: impl Into<String>) -> Agg {
    Agg::new(column, AggregateOp::CountDistinct)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaliased_aggregates_are_named_after_column_and_op() {
        assert_eq!(sum("fare").output_name(), "fare_sum");
        assert_eq!(count("fare").output_name(), "fare_count");
        assert_eq!(mean("fare").output_name(), "fare_mean");
        assert_eq!(min("fare").output_name(), "fare_min");
        assert_eq!(max("fare").output_name(), "fare_max");
        assert_eq!(count_distinct("id").output_name(), "id_count_distinct");
    }

    #[test]
    fn an_alias_names_the_result() {
        let raw = sum("distance_km").alias("total_km").to_raw();
        assert_eq!(raw.column, "distance_km");
        assert_eq!(raw.op, AggregateOp::Sum);
        assert_eq!(raw.alias, "total_km");
    }
}
