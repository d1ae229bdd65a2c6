//! Table operators of the CPU backend: select, filter, with-columns, concat, slice and hash
//! group-by, each over one Arrow `RecordBatch`.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Float64Array, Int64Array, PrimitiveArray, UInt32Array,
};
use arrow::compute;
use arrow::datatypes::{
    ArrowPrimitiveType, DataType, Field, Float64Type, Int64Type, Schema, UInt64Type,
};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, SortField};

use crate::expr::{Expr, ExprError, column_list};

pub use super::filter::filter;
use super::{eval, keys};

/// Why a table operator cannot run.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error(transparent)]
    Expr(#[from] ExprError),
    #[error("unknown column `{column}` in {operator} (the table has: {available})")]
    UnknownColumn {
        operator: &'static str,
        column: String,
        available: String,
    },
    #[error("{operator}: {detail}")]
    Invalid {
        operator: &'static str,
        detail: String,
    },
    #[error("{operator} failed: {source}")]
    Arrow {
        operator: &'static str,
        source: arrow::error::ArrowError,
    },
}

pub(super) fn arrow_err(
    operator: &'static str,
) -> impl FnOnce(arrow::error::ArrowError) -> OpError {
    move |source| OpError::Arrow { operator, source }
}

pub(crate) fn column_index(
    batch: &RecordBatch,
    operator: &'static str,
    name: &str,
) -> Result<usize, OpError> {
    batch
        .schema()
        .index_of(name)
        .map_err(|_| OpError::UnknownColumn {
            operator,
            column: name.to_string(),
            available: column_list(&batch.schema()),
        })
}

/// The named columns, in the order given.
pub fn select(batch: &RecordBatch, columns: &[String]) -> Result<RecordBatch, OpError> {
    let indices = columns
        .iter()
        .map(|name| column_index(batch, "select", name))
        .collect::<Result<Vec<_>, _>>()?;
    batch.project(&indices).map_err(arrow_err("select"))
}

/// Adds or replaces columns, every expression evaluated against the input batch.
pub fn with_columns(
    batch: &RecordBatch,
    columns: &[(String, &Expr)],
) -> Result<RecordBatch, OpError> {
    let mut fields: Vec<Arc<Field>> = batch.schema().fields().iter().cloned().collect();
    let mut arrays: Vec<ArrayRef> = batch.columns().to_vec();
    for (name, expr) in columns {
        let array = eval::evaluate(expr, batch)?;
        let field = Arc::new(Field::new(
            name,
            array.data_type().clone(),
            array.null_count() > 0,
        ));
        match fields.iter().position(|f| f.name() == name) {
            Some(i) => {
                fields[i] = field;
                arrays[i] = array;
            }
            None => {
                fields.push(field);
                arrays.push(array);
            }
        }
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).map_err(arrow_err("with-columns"))
}

/// Concatenates batches whose columns have the same names and types.
pub fn concat(batches: &[&RecordBatch]) -> Result<RecordBatch, OpError> {
    if batches.is_empty() {
        return Err(OpError::Invalid {
            operator: "concat",
            detail: "no tables to concatenate".into(),
        });
    }
    // A column dictionary encoded in some tables and plain in others is decoded in all.
    let unified = super::dictionary::unify(batches).map_err(arrow_err("concat"))?;
    let unified_refs: Vec<&RecordBatch>;
    let batches = match &unified {
        Some(unified) => {
            unified_refs = unified.iter().collect();
            unified_refs.as_slice()
        }
        None => batches,
    };
    let schema = batches[0].schema();
    for (i, batch) in batches.iter().enumerate().skip(1) {
        let other = batch.schema();
        let same = schema.fields().len() == other.fields().len()
            && schema
                .fields()
                .iter()
                .zip(other.fields())
                .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
        if !same {
            return Err(OpError::Invalid {
                operator: "concat",
                detail: format!(
                    "table {i} has columns ({}) but table 0 has ({})",
                    describe(&other),
                    describe(&schema)
                ),
            });
        }
    }
    let nullable: Vec<Arc<Field>> = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let any_nullable = batches.iter().any(|b| b.schema().field(i).is_nullable());
            Arc::new(f.as_ref().clone().with_nullable(any_nullable))
        })
        .collect();
    let schema = Arc::new(Schema::new(nullable));
    super::pooled::concat_batches(&schema, batches).map_err(arrow_err("concat"))
}

fn describe(schema: &Schema) -> String {
    let parts: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| format!("{}: {}", f.name(), f.data_type()))
        .collect();
    parts.join(", ")
}

/// Rows `offset..offset + length`, clamped to the table.
pub fn slice(batch: &RecordBatch, offset: u64, length: u64) -> RecordBatch {
    let (offset, length) = slice_range(batch.num_rows(), offset, length);
    batch.slice(offset, length)
}

/// The `(offset, length)` of a slice of `rows` rows asked for from `offset` over `length`
/// rows, clipped to the rows there are (both backends slice by it).
pub fn slice_range(rows: usize, offset: u64, length: u64) -> (usize, usize) {
    let offset = usize::try_from(offset).unwrap_or(usize::MAX).min(rows);
    let length = usize::try_from(length)
        .unwrap_or(usize::MAX)
        .min(rows - offset);
    (offset, length)
}

/// One row per distinct combination of `columns` (every column when `None`): the first row of
/// each, in order of first occurrence.
pub fn distinct(batch: &RecordBatch, columns: Option<&[String]>) -> Result<RecordBatch, OpError> {
    const OP: &str = "distinct";
    let keys: Vec<ArrayRef> = match columns {
        Some(names) if !names.is_empty() => names
            .iter()
            .map(|n| column_index(batch, OP, n).map(|i| batch.column(i).clone()))
            .collect::<Result<_, _>>()?,
        _ => batch.columns().to_vec(),
    };
    if keys.is_empty() {
        return Ok(batch.clone());
    }
    let (_, first_rows) = keys::group_ids(&keys).map_err(arrow_err(OP))?;
    compute::take_record_batch(batch, &UInt32Array::from(first_rows)).map_err(arrow_err(OP))
}

/// An aggregate function of a group-by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggregateFn {
    Sum,
    Count,
    Mean,
    Min,
    Max,
    CountDistinct,
}

#[derive(Debug, Clone)]
pub struct Aggregate {
    pub column: String,
    pub function: AggregateFn,
    pub alias: String,
}

/// Hash group-by: one row per distinct combination of `keys` (nulls form their own group), the
/// key columns first, then one column per aggregate. Groups appear in order of first occurrence.
pub fn group_by(
    batch: &RecordBatch,
    keys: &[String],
    aggregates: &[Aggregate],
) -> Result<RecordBatch, OpError> {
    const OP: &str = "group-by";
    if keys.is_empty() {
        return Err(OpError::Invalid {
            operator: OP,
            detail: "at least one key column is needed".into(),
        });
    }
    let key_indices = keys
        .iter()
        .map(|k| column_index(batch, OP, k))
        .collect::<Result<Vec<_>, _>>()?;
    let key_arrays: Vec<ArrayRef> = key_indices
        .iter()
        .map(|&i| batch.column(i).clone())
        .collect();
    let (group_of_row, first_rows) = keys::group_ids(&key_arrays).map_err(arrow_err(OP))?;
    let groups = first_rows.len();

    let schema = batch.schema();
    let mut fields: Vec<Field> = key_indices
        .iter()
        .map(|&i| schema.field(i).clone())
        .collect();
    let first_rows = UInt32Array::from(first_rows);
    // One row per group: a dictionary-encoded key is written out (its dictionary may be far
    // larger than the groups).
    let mut columns: Vec<ArrayRef> = key_arrays
        .iter()
        .map(|a| compute::take(a, &first_rows, None).and_then(|k| super::dictionary::plain(&k)))
        .collect::<Result<_, _>>()
        .map_err(arrow_err(OP))?;
    for (field, column) in fields.iter_mut().zip(&columns) {
        *field = field.clone().with_data_type(column.data_type().clone());
    }

    for aggregate in aggregates {
        let values = batch.column(column_index(batch, OP, &aggregate.column)?);
        let result = aggregate_column(values, &group_of_row, groups, aggregate.function).map_err(
            |detail| OpError::Invalid {
                operator: OP,
                detail: format!(
                    "{:?} of column `{}`: {detail}",
                    aggregate.function, aggregate.column
                ),
            },
        )?;
        fields.push(Field::new(
            &aggregate.alias,
            result.data_type().clone(),
            result.null_count() > 0,
        ));
        columns.push(result);
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).map_err(arrow_err(OP))
}

/// The aggregates over the whole table: one row. Sums, counts and means of numbers use Arrow's
/// vectorised reductions; the other aggregates run as a group-by with a single group.
pub fn aggregate(batch: &RecordBatch, aggregates: &[Aggregate]) -> Result<RecordBatch, OpError> {
    const OP: &str = "aggregate";
    let rows = batch.num_rows();
    let mut single_group: Option<Vec<u32>> = None;
    let mut fields = Vec::with_capacity(aggregates.len());
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(aggregates.len());
    for aggregate in aggregates {
        let values = batch.column(column_index(batch, OP, &aggregate.column)?);
        let fast = whole_column(values, aggregate.function).map_err(arrow_err(OP))?;
        let result = match fast {
            Some(result) => result,
            None => {
                let groups = single_group.get_or_insert_with(|| vec![0; rows]);
                aggregate_column(values, groups, 1, aggregate.function).map_err(|detail| {
                    OpError::Invalid {
                        operator: OP,
                        detail: format!(
                            "{:?} of column `{}`: {detail}",
                            aggregate.function, aggregate.column
                        ),
                    }
                })?
            }
        };
        fields.push(Field::new(
            &aggregate.alias,
            result.data_type().clone(),
            result.null_count() > 0,
        ));
        columns.push(result);
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).map_err(arrow_err(OP))
}

/// The column an aggregate reads: counting reads only the validity, which a dictionary's keys
/// carry; every other aggregate reads the values, so a dictionary-encoded column is decoded.
fn aggregated_values(
    values: &ArrayRef,
    function: AggregateFn,
) -> Result<ArrayRef, arrow::error::ArrowError> {
    match function {
        AggregateFn::Count => Ok(values.clone()),
        _ => super::dictionary::plain(values),
    }
}

/// Sum, count and mean of a whole numeric column with Arrow's reductions, typed as the group-by
/// would type them; `None` for the other cases.
fn whole_column(
    values: &ArrayRef,
    function: AggregateFn,
) -> Result<Option<ArrayRef>, arrow::error::ArrowError> {
    let values = &aggregated_values(values, function)?;
    let data_type = values.data_type();
    let valid = (values.len() - values.logical_null_count()) as i64;
    Ok(Some(match function {
        AggregateFn::Count => Arc::new(Int64Array::from(vec![valid])),
        AggregateFn::Sum | AggregateFn::Mean if data_type.is_floating() => {
            let floats = compute::cast(values, &DataType::Float64)?;
            let sum = compute::sum(floats.as_primitive::<Float64Type>());
            let value = match function {
                AggregateFn::Mean => sum.filter(|_| valid > 0).map(|s| s / valid as f64),
                _ => sum,
            };
            Arc::new(Float64Array::from(vec![value]))
        }
        AggregateFn::Sum if data_type.is_signed_integer() => {
            let ints = compute::cast(values, &DataType::Int64)?;
            Arc::new(Int64Array::from(vec![compute::sum(
                ints.as_primitive::<Int64Type>(),
            )]))
        }
        _ => return Ok(None),
    }))
}

fn aggregate_column(
    values: &ArrayRef,
    group_of_row: &[u32],
    groups: usize,
    function: AggregateFn,
) -> Result<ArrayRef, String> {
    let values = &aggregated_values(values, function).map_err(|e| e.to_string())?;
    let data_type = values.data_type();
    match function {
        AggregateFn::Count => {
            let mut counts = vec![0i64; groups];
            match values.logical_nulls().filter(|n| n.null_count() > 0) {
                None => {
                    for &g in group_of_row {
                        counts[g as usize] += 1;
                    }
                }
                Some(nulls) => {
                    for (row, &g) in group_of_row.iter().enumerate() {
                        if nulls.is_valid(row) {
                            counts[g as usize] += 1;
                        }
                    }
                }
            }
            Ok(Arc::new(Int64Array::from(counts)))
        }
        AggregateFn::CountDistinct => {
            let converter = RowConverter::new(vec![SortField::new(data_type.clone())])
                .map_err(|e| e.to_string())?;
            let rows = converter
                .convert_columns(std::slice::from_ref(values))
                .map_err(|e| e.to_string())?;
            let mut seen: Vec<HashSet<&[u8]>> = vec![HashSet::new(); groups];
            for (row, &g) in group_of_row.iter().enumerate() {
                if values.is_valid(row) {
                    seen[g as usize].insert(rows.row(row).data());
                }
            }
            Ok(Arc::new(Int64Array::from_iter_values(
                seen.iter().map(|s| s.len() as i64),
            )))
        }
        AggregateFn::Mean => {
            let values = compute::cast(values, &DataType::Float64).map_err(|e| e.to_string())?;
            let values = values.as_primitive::<Float64Type>();
            let mut sums = vec![0f64; groups];
            let mut counts = vec![0u64; groups];
            if values.null_count() == 0 {
                for (&g, &v) in group_of_row.iter().zip(values.values().iter()) {
                    sums[g as usize] += v;
                    counts[g as usize] += 1;
                }
            } else {
                for (row, &g) in group_of_row.iter().enumerate() {
                    if values.is_valid(row) {
                        sums[g as usize] += values.value(row);
                        counts[g as usize] += 1;
                    }
                }
            }
            Ok(Arc::new(Float64Array::from_iter(
                sums.iter()
                    .zip(&counts)
                    .map(|(s, &c)| (c > 0).then(|| s / c as f64)),
            )))
        }
        AggregateFn::Sum | AggregateFn::Min | AggregateFn::Max => {
            if !data_type.is_numeric() {
                return Err(format!("needs a numeric column, found {data_type}"));
            }
            let cast = |to: &DataType| compute::cast(values, to).map_err(|e| e.to_string());
            let out: ArrayRef = if data_type.is_floating() {
                let values = cast(&DataType::Float64)?;
                let ops = Fold {
                    add: |a: f64, b| a + b,
                    min: f64::min,
                    max: f64::max,
                };
                Arc::new(reduce::<Float64Type>(
                    values.as_primitive(),
                    group_of_row,
                    groups,
                    function,
                    ops,
                ))
            } else if data_type.is_unsigned_integer() {
                let values = cast(&DataType::UInt64)?;
                let ops = Fold {
                    add: u64::wrapping_add,
                    min: u64::min,
                    max: u64::max,
                };
                Arc::new(reduce::<UInt64Type>(
                    values.as_primitive(),
                    group_of_row,
                    groups,
                    function,
                    ops,
                ))
            } else {
                let values = cast(&DataType::Int64)?;
                let ops = Fold {
                    add: i64::wrapping_add,
                    min: i64::min,
                    max: i64::max,
                };
                Arc::new(reduce::<Int64Type>(
                    values.as_primitive(),
                    group_of_row,
                    groups,
                    function,
                    ops,
                ))
            };
            finish(function, out, data_type)
        }
    }
}

/// How one value type sums and compares in a group-by.
struct Fold<N> {
    add: fn(N, N) -> N,
    min: fn(N, N) -> N,
    max: fn(N, N) -> N,
}

/// Sums, minimum or maximum of the valid values of each group; groups with no valid value are
/// null.
fn reduce<T: ArrowPrimitiveType>(
    values: &PrimitiveArray<T>,
    group_of_row: &[u32],
    groups: usize,
    function: AggregateFn,
    ops: Fold<T::Native>,
) -> PrimitiveArray<T> {
    let fold = |acc: Option<T::Native>, v: T::Native| match (function, acc) {
        (_, None) => v,
        (AggregateFn::Sum, Some(a)) => (ops.add)(a, v),
        (AggregateFn::Min, Some(a)) => (ops.min)(a, v),
        (_, Some(a)) => (ops.max)(a, v),
    };
    if values.null_count() == 0 && function == AggregateFn::Sum {
        // Every group has at least one row, so every sum starts from a real value.
        let mut sums = vec![T::Native::default(); groups];
        for (&g, &v) in group_of_row.iter().zip(values.values().iter()) {
            let slot = &mut sums[g as usize];
            *slot = (ops.add)(*slot, v);
        }
        return PrimitiveArray::<T>::from_iter_values(sums);
    }
    let mut acc: Vec<Option<T::Native>> = vec![None; groups];
    for (row, &g) in group_of_row.iter().enumerate() {
        if values.is_valid(row) {
            let slot = &mut acc[g as usize];
            *slot = Some(fold(*slot, values.value(row)));
        }
    }
    PrimitiveArray::<T>::from_iter(acc)
}

/// Min and max keep the input's type; sums stay 64-bit.
fn finish(function: AggregateFn, out: ArrayRef, input: &DataType) -> Result<ArrayRef, String> {
    match function {
        AggregateFn::Min | AggregateFn::Max => {
            compute::cast(&out, input).map_err(|e| e.to_string())
        }
        _ => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, StringArray};

    fn batch() -> RecordBatch {
        let schema = Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("n", DataType::Int32, true),
            Field::new("x", DataType::Float64, true),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(StringArray::from(vec![
                    Some("a"),
                    Some("b"),
                    Some("a"),
                    None,
                    Some("b"),
                ])),
                Arc::new(Int32Array::from(vec![
                    Some(1),
                    Some(2),
                    Some(3),
                    Some(4),
                    None,
                ])),
                Arc::new(Float64Array::from(vec![1.0, 2.0, 3.0, 4.0, 2.0])),
            ],
        )
        .unwrap()
    }

    fn agg(column: &str, function: AggregateFn, alias: &str) -> Aggregate {
        Aggregate {
            column: column.into(),
            function,
            alias: alias.into(),
        }
    }

    #[test]
    fn group_by_string_key_with_every_aggregate() {
        let out = group_by(
            &batch(),
            &["k".into()],
            &[
                agg("n", AggregateFn::Sum, "n_sum"),
                agg("n", AggregateFn::Count, "n_count"),
                agg("x", AggregateFn::Mean, "x_mean"),
                agg("n", AggregateFn::Min, "n_min"),
                agg("x", AggregateFn::Max, "x_max"),
                agg("x", AggregateFn::CountDistinct, "x_distinct"),
            ],
        )
        .unwrap();
        assert_eq!(out.num_rows(), 3);
        let keys = out.column(0).as_string::<i32>();
        assert_eq!((keys.value(0), keys.value(1)), ("a", "b"));
        assert!(keys.is_null(2));
        let sums = out.column(1).as_primitive::<Int64Type>();
        assert_eq!((sums.value(0), sums.value(1), sums.value(2)), (4, 2, 4));
        let counts = out.column(2).as_primitive::<Int64Type>();
        assert_eq!(counts.values(), &[2, 1, 1]);
        let means = out.column(3).as_primitive::<Float64Type>();
        assert_eq!(means.values(), &[2.0, 2.0, 4.0]);
        assert_eq!(out.column(4).data_type(), &DataType::Int32);
        let distinct = out.column(6).as_primitive::<Int64Type>();
        assert_eq!(distinct.values(), &[2, 1, 1]);
    }

    #[test]
    fn whole_table_aggregates_agree_with_a_single_group() {
        let aggs = [
            agg("n", AggregateFn::Sum, "n_sum"),
            agg("x", AggregateFn::Sum, "x_sum"),
            agg("n", AggregateFn::Count, "n_count"),
            agg("x", AggregateFn::Mean, "x_mean"),
            agg("n", AggregateFn::Min, "n_min"),
            agg("k", AggregateFn::CountDistinct, "k_distinct"),
        ];
        let whole = aggregate(&batch(), &aggs).unwrap();
        let one_key = with_columns(
            &batch(),
            &[("one".into(), &Expr::Literal(crate::expr::Literal::Int64(1)))],
        )
        .unwrap();
        let grouped = group_by(&one_key, &["one".into()], &aggs).unwrap();
        assert_eq!(whole.num_rows(), 1);
        for (i, field) in whole.schema().fields().iter().enumerate() {
            assert_eq!(
                whole.column(i).to_data(),
                grouped.column(i + 1).to_data(),
                "{}",
                field.name()
            );
        }
    }

    #[test]
    fn unknown_key_is_named() {
        let err = group_by(&batch(), &["kk".into()], &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`kk`") && err.contains("group-by") && err.contains("k, n, x"),
            "{err}"
        );
    }

    #[test]
    fn concat_rejects_mismatched_schemas_naming_both() {
        let a = batch();
        let b = select(&a, &["k".into()]).unwrap();
        let err = concat(&[&a, &b]).unwrap_err().to_string();
        assert!(err.contains("table 1 has columns (k: Utf8)"), "{err}");
        let twice = concat(&[&a, &a]).unwrap();
        assert_eq!(twice.num_rows(), 10);
    }

    #[test]
    fn distinct_keeps_the_first_row_of_each_combination() {
        let out = distinct(&batch(), Some(&["k".into()])).unwrap();
        let n = out.column(1).as_primitive::<arrow::datatypes::Int32Type>();
        assert_eq!(n.iter().collect::<Vec<_>>(), [Some(1), Some(2), Some(4)]);
        assert_eq!(distinct(&batch(), None).unwrap().num_rows(), 5);
        let twice = concat(&[&batch(), &batch()]).unwrap();
        assert_eq!(distinct(&twice, None).unwrap().num_rows(), 5);
    }

    #[test]
    fn slice_is_clamped() {
        assert_eq!(slice(&batch(), 3, 100).num_rows(), 2);
        assert_eq!(slice(&batch(), 30, 1).num_rows(), 0);
    }
}
