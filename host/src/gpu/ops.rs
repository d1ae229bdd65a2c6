//! Table operators on device tables, mirroring the CPU backend (`cpu::ops`, `cpu::partition`,
//! `cpu::sort`, `cpu::join`) with the same results:
//!
//! - [`evaluate`] runs an expression's fused kernel; [`filter`] keeps the rows where a predicate
//!   is true (stream compaction by prefix sum, then gathers);
//! - [`hash_partition`] splits by the pinned partition hash (`cpu/keys.rs`), each part in input
//!   order;
//! - [`group_by`] on fixed-width and string keys: a hash table built with atomics, groups
//!   numbered by first occurrence (several keys grouped one at a time, each row's groups so far
//!   and its next key's group making the next word to group), sum/count/mean/min/max with
//!   atomics, count-distinct by grouping (group, value) pairs;
//! - [`sort`]: stable LSD radix sort of order-preserving key words, any number of fixed-width
//!   or string keys, ascending or descending, nulls first or last (a string key sorts its
//!   distinct strings, then the rows by their string's rank);
//! - [`join`] on fixed-width or string keys: inner, left, semi, anti (build on the right
//!   table: its valid rows sorted by key, runs hashed; probe with the left); several key
//!   pairs are grouped over both tables at once into one word per row;
//! - [`distinct`]: the first row of each group of some or all columns;
//! - [`concat`] of tables with the same columns;
//! - [`aggregate`] over the whole table (a group-by on a key every row shares);
//! - [`select`], [`with_columns`] (columns shared with the input, not copied), [`slice`] and
//!   [`top_k`] (a sort, then a slice).
//!
//! String keys are matched by a 64-bit hash of their bytes, checked: rows whose hashes are
//! equal are compared byte for byte, so a collision never merges two keys (a group-by or a
//! join build that meets one is refused, a probe drops the false match).
//!
//! What a kernel does not cover yet (string expressions other than a literal, an empty
//! table's aggregate, strings longer than [`SORT_STRING_BYTES`] as sort keys) is refused with
//! [`GpuOpError::Unsupported`]: the caller keeps that operator on the CPU backend.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};

use super::GpuRuntime;
use super::exec::{
    self, Arg, ExecError, NONE, alloc, check_rows, filled_u8, filled_u32, filled_u64,
    gather_column, gather_table, gather_values, iota, radix_sort, run, run_accumulate,
    selected_rows,
};
use super::join_index::JoinIndex;
use super::kernels::fused::{self, CodegenError, LiteralArg};
use super::table::{DeviceColumn, DeviceTable, TableError, to_host, value_width};
use crate::cpu::join::JoinType;
use crate::cpu::ops::{Aggregate, AggregateFn};
use crate::cpu::sort::SortKey;
use crate::expr::{Expr, ExprError, Literal};

#[derive(Debug, thiserror::Error)]
pub enum GpuOpError {
    #[error("{operator} on the GPU: {detail}")]
    Unsupported {
        operator: &'static str,
        detail: String,
    },
    #[error("{operator}: {detail}")]
    Invalid {
        operator: &'static str,
        detail: String,
    },
    #[error(transparent)]
    Expr(#[from] ExprError),
    #[error(transparent)]
    Exec(#[from] ExecError),
}

impl From<CodegenError> for GpuOpError {
    fn from(e: CodegenError) -> Self {
        match e {
            CodegenError::Type(e) => GpuOpError::Expr(e),
            other => GpuOpError::Unsupported {
                operator: "expression",
                detail: other.to_string(),
            },
        }
    }
}

impl From<super::kernels::KernelError> for GpuOpError {
    fn from(e: super::kernels::KernelError) -> Self {
        GpuOpError::Exec(ExecError::Kernel(e))
    }
}

impl From<TableError> for GpuOpError {
    fn from(e: TableError) -> Self {
        GpuOpError::Exec(ExecError::Table(e))
    }
}

impl From<super::pool::PoolError> for GpuOpError {
    fn from(e: super::pool::PoolError) -> Self {
        GpuOpError::Exec(ExecError::Pool(e))
    }
}

/// The position of column `name` in `table`, or the error naming the columns it has.
fn column_index(
    table: &DeviceTable,
    operator: &'static str,
    name: &str,
) -> Result<usize, GpuOpError> {
    table
        .schema
        .index_of(name)
        .map_err(|_| GpuOpError::Invalid {
            operator,
            detail: format!(
                "no column `{name}` (the table has: {})",
                crate::expr::column_list(&table.schema)
            ),
        })
}

fn column_of<'a>(
    table: &'a DeviceTable,
    operator: &'static str,
    name: &str,
) -> Result<&'a DeviceColumn, GpuOpError> {
    Ok(&table.columns[column_index(table, operator, name)?])
}

/// The suffix of the fixed kernels for a column type's storage (`i32` for dates, `i64` for
/// timestamps, `u8` for booleans), or `None` for strings and nulls.
fn storage_suffix(data_type: &DataType) -> Option<&'static str> {
    use DataType::*;
    Some(match data_type {
        Int8 => "i8",
        Int16 => "i16",
        Int32 | Date32 => "i32",
        Int64 | Timestamp(_, _) => "i64",
        UInt8 | Boolean => "u8",
        UInt16 => "u16",
        UInt32 => "u32",
        UInt64 => "u64",
        Float32 => "f32",
        Float64 => "f64",
        _ => return None,
    })
}

/// Whether the kernels cover `expr` over a table of `schema` (a device table's schema, see
/// [`super::table::device_schema`]). These `covers` checks let a caller keep a table off the
/// device for an operator that would refuse it; each operator checks again and says why.
pub fn expression_covers(schema: &Schema, expr: &Expr) -> bool {
    matches!(expr, Expr::Column(_) | Expr::Literal(Literal::Utf8(_)))
        || fused::generate(expr, schema).is_ok()
}

/// Whether the kernels group, join and sort by a key of this type: fixed-width or strings.
fn key_type_covered(data_type: &DataType) -> bool {
    storage_suffix(data_type).is_some() || *data_type == DataType::Utf8
}

/// Whether the kernels cover sorting a table of `schema` by `keys` (fixed-width or string
/// keys; how long the strings are is only known on the device).
pub fn sort_covers(schema: &Schema, keys: &[SortKey]) -> bool {
    keys.iter().all(|k| {
        schema
            .field_with_name(&k.column)
            .is_ok_and(|f| key_type_covered(f.data_type()))
    })
}

/// Whether the kernels cover a group-by of a table of `schema`: fixed-width or string keys,
/// and aggregates [`aggregate_covers`] covers.
pub fn group_by_covers(schema: &Schema, keys: &[String], aggregates: &[Aggregate]) -> bool {
    !keys.is_empty() && keys_covered(schema, keys) && aggregate_covers(schema, aggregates)
}

/// Whether every one of `columns` of `schema` is a key type the kernels group by.
fn keys_covered<'a>(schema: &Schema, columns: impl IntoIterator<Item = &'a String>) -> bool {
    columns.into_iter().all(|name| {
        schema
            .field_with_name(name)
            .is_ok_and(|f| key_type_covered(f.data_type()))
    })
}

/// Whether the kernels cover these aggregates over a table of `schema` (a count-distinct
/// groups its column, which must be a key type).
pub fn aggregate_covers(schema: &Schema, aggregates: &[Aggregate]) -> bool {
    aggregates
        .iter()
        .all(|a| a.function != AggregateFn::CountDistinct || keys_covered(schema, [&a.column]))
}

/// Whether the kernels cover `distinct` over `columns` (every column when `None` or empty)
/// of a table of `schema`.
pub fn distinct_covers(schema: &Schema, columns: Option<&[String]>) -> bool {
    match columns {
        Some(names) if !names.is_empty() => keys_covered(schema, names),
        _ => schema
            .fields()
            .iter()
            .all(|f| key_type_covered(f.data_type())),
    }
}

/// Whether the kernels cover joining tables of `left` and `right` on these keys: pairs of
/// types the kernels compare as the CPU backend does.
pub fn join_covers(left: &Schema, right: &Schema, left_on: &[String], right_on: &[String]) -> bool {
    !left_on.is_empty()
        && left_on.len() == right_on.len()
        && left_on.iter().zip(right_on).all(|(left_key, right_key)| {
            match (
                left.field_with_name(left_key),
                right.field_with_name(right_key),
            ) {
                (Ok(l), Ok(r)) => joinable(l.data_type(), r.data_type()),
                _ => false,
            }
        })
}

/// Fields to build a new schema from.
fn owned_fields(fields: &[arrow::datatypes::FieldRef]) -> Vec<Field> {
    fields.iter().map(|f| f.as_ref().clone()).collect()
}

/// A copy of `column` (device to device).
fn copy_column(runtime: &GpuRuntime, column: &DeviceColumn) -> Result<DeviceColumn, GpuOpError> {
    let indices = iota(runtime, 0, column.len)?;
    Ok(gather_column(runtime, column, &indices, column.len, false)?)
}

/// How many rows each thread of a fused kernel evaluates (see [`run_fused`]). With the
/// registers capped for 7 resident blocks (`fused::MIN_BLOCKS`), the haversine over 20 M rows
/// took, with 1, 2, 4 and 16 rows a thread, 0.247, 0.247, 0.246 and 0.251 ms on an H200 and
/// 0.280, 0.291, 0.300 and 0.299 ms on an H100: more rows a thread gained nothing once enough
/// threads were resident. (Past 2^28 rows the grid is capped and threads take several.)
const FUSED_ROWS_PER_THREAD: usize = 1;

/// `expr` over `table`, in one fused kernel.
pub fn evaluate(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    expr: &Expr,
) -> Result<DeviceColumn, GpuOpError> {
    match expr {
        Expr::Column(name) => return copy_column(runtime, column_of(table, "evaluate", name)?),
        Expr::Literal(Literal::Utf8(text)) => return repeated_string(runtime, text, table.rows),
        _ => {}
    }
    let kernel = runtime.kernels.plan(expr, &validity_schema(table))?;
    run_fused(runtime, table, expr, &kernel, FUSED_ROWS_PER_THREAD)
}

/// Runs `kernel`, the fused kernel of `expr` over `table`, on a grid of one thread per
/// `rows_per_thread` rows. A thread with several rows evaluates them two at a time, so two
/// overlap the latency of one's loads and of its arithmetic (a haversine's double-precision
/// sines and arcsine); with one row per thread the GPU hides latency with more threads alone.
/// The benchmark measures both.
pub(crate) fn run_fused(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    expr: &Expr,
    kernel: &fused::FusedKernel,
    rows_per_thread: usize,
) -> Result<DeviceColumn, GpuOpError> {
    let function = runtime.kernels.fused(kernel)?;
    let n = table.rows;
    // Only a kernel that can fail has an error flag to read back, which waits for it; any
    // other evaluation is queued on the stream and returns at once.
    let error = match kernel.may_fail {
        true => Some(filled_u32(runtime, 1, 0)?),
        false => None,
    };
    let width = value_width(&kernel.output.data_type()).unwrap_or(8);
    let out = alloc(runtime, n, width)?;
    let out_valid = match kernel.nullable {
        true => Some(alloc(runtime, n, 1)?),
        false => None,
    };
    // String literals go to the device first (a few bytes each, not a table transfer).
    let strings = kernel
        .literals
        .iter()
        .filter_map(|literal| match literal {
            LiteralArg::Str(text) => Some(super::table::to_device(runtime, text.as_bytes())),
            _ => None,
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut strings = strings.iter();
    let mut args = vec![Arg::I64(n as i64), Arg::Opt(error.as_ref())];
    for input in &kernel.inputs {
        let column = column_of(table, "evaluate", &input.column)?;
        if column.data_type == DataType::Utf8 {
            args.push(Arg::Buf(string_offsets(column, "evaluate", &input.column)?));
        }
        if column.data_type == DataType::Null {
            args.push(Arg::Opt(None));
        } else {
            args.push(Arg::Buf(&column.values));
        }
        args.push(Arg::Opt(column.validity.as_ref()));
    }
    for literal in &kernel.literals {
        match literal {
            LiteralArg::F64(v) => args.push(Arg::F64(*v)),
            LiteralArg::I64(v) => args.push(Arg::I64(*v)),
            LiteralArg::U64(v) => args.push(Arg::U64(*v)),
            LiteralArg::Bool(v) => args.push(Arg::I32(i32::from(*v))),
            LiteralArg::Str(text) => {
                let bytes = strings.next().ok_or_else(|| GpuOpError::Invalid {
                    operator: "evaluate",
                    detail: "a string literal without its device copy".into(),
                })?;
                args.push(Arg::Buf(bytes));
                args.push(Arg::I32(text.len() as i32));
            }
        }
    }
    args.push(Arg::Buf(&out));
    args.push(Arg::Opt(out_valid.as_ref()));
    exec::launch(
        runtime,
        &function,
        &kernel.shape,
        exec::rows_config(n.div_ceil(rows_per_thread.max(1))),
        &args,
    )?;
    let failed = match &error {
        Some(error) => exec::read_u32(runtime, error, 0)? != 0,
        None => false,
    };
    if failed {
        return Err(ExprError::Evaluation {
            expr: expr.to_string(),
            detail: "Divide by zero error".into(),
        }
        .into());
    }
    Ok(DeviceColumn {
        data_type: kernel.output.data_type(),
        len: n,
        values: out,
        offsets: None,
        validity: out_valid,
    })
}

/// `table`'s schema with each field nullable exactly where its device column has a validity
/// buffer, as the kernel generator reads it: the validity of a column without one is never
/// read, and a column with one is never taken to have no nulls.
pub(crate) fn validity_schema(table: &DeviceTable) -> Schema {
    let fields = table.schema.fields().iter().zip(&table.columns);
    Schema::new(
        fields
            .map(|(field, column)| {
                field
                    .as_ref()
                    .clone()
                    .with_nullable(column.validity.is_some())
            })
            .collect::<Vec<_>>(),
    )
}

/// A string column of `rows` copies of `text` (a string literal as a column, such as a
/// constant label added to a table).
fn repeated_string(
    runtime: &GpuRuntime,
    text: &str,
    rows: usize,
) -> Result<DeviceColumn, GpuOpError> {
    let len = text.len();
    let total = rows
        .checked_mul(len)
        .filter(|total| i32::try_from(*total).is_ok())
        .ok_or_else(|| GpuOpError::Unsupported {
            operator: "evaluate",
            detail: format!("{rows} copies of a {len}-byte string exceed 32-bit offsets"),
        })?;
    let literal = super::table::to_device(runtime, text.as_bytes())?;
    let offsets = alloc(runtime, rows + 1, 4)?;
    let bytes = alloc(runtime, total, 1)?;
    run(
        runtime,
        "wrk_repeat_str",
        rows + 1,
        &[
            Arg::Buf(&literal),
            Arg::I32(len as i32),
            Arg::Buf(&offsets),
            Arg::Buf(&bytes),
            Arg::I64(rows as i64),
        ],
    )?;
    Ok(DeviceColumn {
        data_type: DataType::Utf8,
        len: rows,
        values: bytes,
        offsets: Some(offsets),
        validity: None,
    })
}

/// The named columns of `table`, in that order: shared with `table`, not copied.
pub fn select(table: &DeviceTable, names: &[String]) -> Result<DeviceTable, GpuOpError> {
    let mut fields = Vec::with_capacity(names.len());
    let mut columns = Vec::with_capacity(names.len());
    for name in names {
        let index = column_index(table, "select", name)?;
        fields.push(table.schema.field(index).clone());
        columns.push(table.columns[index].clone());
    }
    Ok(DeviceTable {
        schema: Arc::new(Schema::new(fields)),
        columns,
        rows: table.rows,
    })
}

/// `table` with a column per `(name, expression)`, each evaluated over `table` as it came:
/// a name the table has is replaced in place, a new one appended. The input's other columns
/// are shared, not copied.
pub fn with_columns(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    columns: &[(String, &Expr)],
) -> Result<DeviceTable, GpuOpError> {
    let mut fields = owned_fields(table.schema.fields());
    let mut out = table.columns.clone();
    for (name, expr) in columns {
        let column = match expr {
            // A column under another name: the same device buffers.
            Expr::Column(source) => {
                table.columns[column_index(table, "with-columns", source)?].clone()
            }
            _ => Arc::new(evaluate(runtime, table, expr)?),
        };
        let field = Field::new(name, column.data_type.clone(), column.validity.is_some());
        match fields.iter().position(|f| f.name() == name) {
            Some(i) => {
                fields[i] = field;
                out[i] = column;
            }
            None => {
                fields.push(field);
                out.push(column);
            }
        }
    }
    Ok(DeviceTable {
        schema: Arc::new(Schema::new(fields)),
        columns: out,
        rows: table.rows,
    })
}

/// Rows `offset..offset + length` of `table`, clipped to its rows (`cpu::ops::slice_range`).
pub fn slice(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    offset: u64,
    length: u64,
) -> Result<DeviceTable, GpuOpError> {
    let rows = table.rows;
    let (offset, length) = crate::cpu::ops::slice_range(rows, offset, length);
    check_rows(rows)?;
    // `check_rows` bounds `rows`, hence `offset`, to `u32`.
    let start = u32::try_from(offset).unwrap_or(u32::MAX);
    let indices = iota(runtime, start, length)?;
    Ok(gather_table(runtime, table, &indices, length)?)
}

/// The first `k` rows of the order `keys` gives: [`sort`], then [`slice`].
pub fn top_k(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    keys: &[SortKey],
    k: u64,
) -> Result<DeviceTable, GpuOpError> {
    let sorted = sort(runtime, table, keys)?;
    if (sorted.rows as u64) <= k {
        return Ok(sorted);
    }
    slice(runtime, &sorted, 0, k)
}

/// The rows of `table` where `predicate` is true (null counts as false).
pub fn filter(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    predicate: &Expr,
) -> Result<DeviceTable, GpuOpError> {
    let data_type = predicate.data_type(&table.schema)?;
    if data_type != DataType::Boolean {
        return Err(GpuOpError::Invalid {
            operator: "filter",
            detail: format!("the predicate `{predicate}` is {data_type}, not boolean"),
        });
    }
    let mask = evaluate(runtime, table, predicate)?;
    let n = table.rows;
    let flags = alloc(runtime, n, 4)?;
    run(
        runtime,
        "wrk_mask_flags",
        n,
        &[
            Arg::Buf(&mask.values),
            Arg::Opt(mask.validity.as_ref()),
            Arg::Buf(&flags),
            Arg::I64(n as i64),
        ],
    )?;
    let (indices, m) = selected_rows(runtime, &flags, n)?;
    Ok(gather_table(runtime, table, &indices, m)?)
}

/// The rows of `table` split into `partitions` tables by the partition hash of `keys`; row `r`
/// goes to table `hash % partitions`, each keeping the input's row order.
pub fn hash_partition(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    keys: &[String],
    partitions: u32,
) -> Result<Vec<DeviceTable>, GpuOpError> {
    const OP: &str = "hash-partition";
    if keys.is_empty() || partitions == 0 {
        return Err(GpuOpError::Invalid {
            operator: OP,
            detail: format!(
                "needs at least one key and one partition, got {} keys and {partitions} partitions",
                keys.len()
            ),
        });
    }
    let n = table.rows;
    check_rows(n)?;
    let hashes = filled_u64(runtime, n, 0)?;
    for key in keys {
        let column = column_of(table, OP, key)?;
        let rows = Arg::I64(n as i64);
        if column.data_type == DataType::Utf8 {
            let offsets = string_offsets(column, OP, key)?;
            run(
                runtime,
                "wrk_hash_str",
                n,
                &[
                    Arg::Buf(offsets),
                    Arg::Buf(&column.values),
                    Arg::Opt(column.validity.as_ref()),
                    Arg::Buf(&hashes),
                    rows,
                ],
            )?;
            continue;
        }
        let suffix = storage_suffix(&column.data_type).ok_or_else(|| GpuOpError::Invalid {
            operator: OP,
            detail: format!("cannot hash-partition a key of type {}", column.data_type),
        })?;
        run(
            runtime,
            &format!("wrk_hash_{suffix}"),
            n,
            &[
                Arg::Buf(&column.values),
                Arg::Opt(column.validity.as_ref()),
                Arg::Buf(&hashes),
                rows,
            ],
        )?;
    }
    // Each row's partition, and each partition's row count.
    let words = alloc(runtime, n, 8)?;
    let counts = filled_u32(runtime, partitions as usize, 0)?;
    run_accumulate(
        runtime,
        "wrk_partition_of",
        n,
        partitions as usize,
        &[
            Arg::Buf(&hashes),
            Arg::U64(u64::from(partitions)),
            Arg::Buf(&words),
            Arg::Buf(&counts),
            Arg::I64(n as i64),
        ],
    )?;
    let counts = to_host(runtime, &counts, partitions as usize * 4)?;
    // The row indices by partition (stable: a partition keeps the input's row order), then
    // each partition's rows gathered from its run of them: one pass over the data in all.
    let order = radix_sort(runtime, &words, iota(runtime, 0, n)?, n)?;
    let mut parts = Vec::with_capacity(partitions as usize);
    let mut start = 0u32;
    for count in counts.chunks_exact(4) {
        let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]);
        let rows = count as usize;
        let positions = iota(runtime, start, rows)?;
        let indices = gather_values(runtime, &order, 4, &positions, rows)?;
        parts.push(gather_table(runtime, table, &indices, rows)?);
        start += count;
    }
    Ok(parts)
}

/// The rows of `table` ordered by `keys` (stable: equal keys keep their input order).
pub fn sort(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    keys: &[SortKey],
) -> Result<DeviceTable, GpuOpError> {
    const OP: &str = "sort";
    if keys.is_empty() {
        return Err(GpuOpError::Invalid {
            operator: OP,
            detail: "at least one sort key is needed".into(),
        });
    }
    let n = table.rows;
    check_rows(n)?;
    let mut perm = iota(runtime, 0, n)?;
    let words = alloc(runtime, n, 8)?;
    // LSD: the last key first; within a key, its values first and its null pass last.
    for key in keys.iter().rev() {
        let column = column_of(table, OP, &key.column)?;
        if column.data_type == DataType::Utf8 {
            string_order_words(runtime, column, key, &words)?;
        } else {
            let suffix =
                storage_suffix(&column.data_type).ok_or_else(|| GpuOpError::Unsupported {
                    operator: OP,
                    detail: format!(
                        "sorting by `{}` of type {} has no kernel yet",
                        key.column, column.data_type
                    ),
                })?;
            run(
                runtime,
                &format!("wrk_order_word_{suffix}"),
                n,
                &[
                    Arg::Buf(&column.values),
                    Arg::Opt(column.validity.as_ref()),
                    Arg::I32(i32::from(key.descending)),
                    Arg::Buf(&words),
                    Arg::I64(n as i64),
                ],
            )?;
        }
        perm = radix_sort(runtime, &words, perm, n)?;
        if column.validity.is_some() {
            run(
                runtime,
                "wrk_null_word",
                n,
                &[
                    Arg::Opt(column.validity.as_ref()),
                    Arg::I32(i32::from(key.nulls_first)),
                    Arg::Buf(&words),
                    Arg::I64(n as i64),
                ],
            )?;
            perm = radix_sort(runtime, &words, perm, n)?;
        }
    }
    Ok(gather_table(runtime, table, &perm, n)?)
}

/// The longest strings a sort key may hold on the device: the distinct strings are sorted 8
/// bytes per radix pass over their whole length, so longer keys are sorted by the CPU backend.
pub const SORT_STRING_BYTES: usize = 256;

/// The order words of a string sort key, into `words`: each row's rank among the column's
/// distinct strings (in `key`'s direction). The distinct strings (one row per group) are sorted
/// by an LSD radix sort of their lengths, then their bytes 8 at a time from the last to the
/// first, so a column of few distinct strings costs few passes over few rows.
fn string_order_words(
    runtime: &GpuRuntime,
    column: &DeviceColumn,
    key: &SortKey,
    words: &super::pool::DeviceBuffer,
) -> Result<(), GpuOpError> {
    const OP: &str = "sort";
    let n = column.len;
    let offsets = string_offsets(column, OP, &key.column)?;
    let groups = key_groups(runtime, column, OP, &key.column)?;
    let distinct = groups.groups;
    let longest = filled_u32(runtime, 1, 0)?;
    run(
        runtime,
        "wrk_str_longest",
        distinct,
        &[
            Arg::Buf(offsets),
            Arg::Buf(&groups.first_row),
            Arg::Buf(&longest),
            Arg::I64(distinct as i64),
        ],
    )?;
    let longest = exec::read_u32(runtime, &longest, 0)? as usize;
    if longest > SORT_STRING_BYTES {
        return Err(GpuOpError::Unsupported {
            operator: OP,
            detail: format!(
                "`{}` holds strings of {longest} bytes; the kernels sort strings of up to \
                 {SORT_STRING_BYTES}",
                key.column
            ),
        });
    }
    let chunk_words = alloc(runtime, distinct, 8)?;
    let mut order = iota(runtime, 0, distinct)?;
    // Chunk -1 is the length (the last tie-break), then the bytes from the last chunk.
    for chunk in std::iter::once(-1).chain((0..longest.div_ceil(8) as i32).rev()) {
        run(
            runtime,
            "wrk_str_order_word",
            distinct,
            &[
                Arg::Buf(offsets),
                Arg::Buf(&column.values),
                Arg::Buf(&groups.first_row),
                Arg::I32(chunk),
                Arg::I32(i32::from(key.descending)),
                Arg::Buf(&chunk_words),
                Arg::I64(distinct as i64),
            ],
        )?;
        order = radix_sort(runtime, &chunk_words, order, distinct)?;
    }
    let rank = alloc(runtime, distinct, 4)?;
    run(
        runtime,
        "wrk_ranks",
        distinct,
        &[Arg::Buf(&order), Arg::Buf(&rank), Arg::I64(distinct as i64)],
    )?;
    run(
        runtime,
        "wrk_rank_words",
        n,
        &[
            Arg::Buf(&groups.row_group),
            Arg::Buf(&rank),
            Arg::Buf(words),
            Arg::I64(n as i64),
        ],
    )?;
    Ok(())
}

/// The aggregates over the whole table, in one row: a group-by on a key every row shares,
/// without the key. An empty table's row (nulls and zero counts) is left to the CPU backend.
pub fn aggregate(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    aggregates: &[Aggregate],
) -> Result<DeviceTable, GpuOpError> {
    const OP: &str = "aggregate";
    let rows = table.rows;
    if rows == 0 {
        return Err(GpuOpError::Unsupported {
            operator: OP,
            detail: "an empty table".into(),
        });
    }
    let mut key = String::from("__wrk_whole_table");
    while table.schema.index_of(&key).is_ok() {
        key.push('_');
    }
    let mut fields = owned_fields(table.schema.fields());
    fields.push(Field::new(&key, DataType::UInt8, false));
    let mut columns = table.columns.clone();
    columns.push(Arc::new(DeviceColumn {
        data_type: DataType::UInt8,
        len: rows,
        values: filled_u8(runtime, rows, 0)?,
        offsets: None,
        validity: None,
    }));
    let keyed = DeviceTable {
        schema: Arc::new(Schema::new(fields)),
        columns,
        rows,
    };
    let grouped = group_by(runtime, &keyed, &[key], aggregates)?;
    // The key is the first column.
    Ok(DeviceTable {
        schema: Arc::new(Schema::new(owned_fields(&grouped.schema.fields()[1..]))),
        columns: grouped.columns[1..].to_vec(),
        rows: grouped.rows,
    })
}

/// A string column's offsets (`name` for the error).
pub(super) fn string_offsets<'a>(
    column: &'a DeviceColumn,
    operator: &'static str,
    name: &str,
) -> Result<&'a super::pool::DeviceBuffer, GpuOpError> {
    column.offsets.as_ref().ok_or_else(|| GpuOpError::Invalid {
        operator,
        detail: format!("string column `{name}` has no offsets"),
    })
}

/// The equality words of a key column: exact for fixed-width keys; for strings the XXH64 of
/// their bytes, which the caller must check (see [`key_groups`], [`JoinIndex::build`]).
fn equality_words(
    runtime: &GpuRuntime,
    column: &DeviceColumn,
    operator: &'static str,
    name: &str,
) -> Result<super::pool::DeviceBuffer, GpuOpError> {
    let words = alloc(runtime, column.len, 8)?;
    if column.data_type == DataType::Utf8 {
        run(
            runtime,
            "wrk_eq_word_str",
            column.len,
            &[
                Arg::Buf(string_offsets(column, operator, name)?),
                Arg::Buf(&column.values),
                Arg::Buf(&words),
                Arg::I64(column.len as i64),
            ],
        )?;
        return Ok(words);
    }
    let suffix = storage_suffix(&column.data_type).ok_or_else(|| GpuOpError::Unsupported {
        operator,
        detail: format!(
            "`{name}`: keys of type {} have no kernel yet",
            column.data_type
        ),
    })?;
    run(
        runtime,
        &format!("wrk_eq_word_{suffix}"),
        column.len,
        &[
            Arg::Buf(&column.values),
            Arg::Buf(&words),
            Arg::I64(column.len as i64),
        ],
    )?;
    Ok(words)
}

/// A power-of-two hash table size with room for `entries` at half load.
pub(super) fn table_capacity(entries: usize) -> usize {
    (entries * 2).max(16).next_power_of_two()
}

/// Rows grouped by equal `words` (rows whose `validity` says null forming one group of their
/// own): each row's group, the number of groups, and each group's first row. Groups are
/// numbered in order of first occurrence.
struct RowGroups {
    row_group: super::pool::DeviceBuffer,
    groups: usize,
    first_row: super::pool::DeviceBuffer,
}

/// The rows of one key column (`name`) grouped by equal keys. String keys are grouped by
/// their hashes, then every row is compared with its group's first row: a hash collision
/// (two strings in one group) refuses the operator, which the CPU backend then runs.
fn key_groups(
    runtime: &GpuRuntime,
    column: &DeviceColumn,
    operator: &'static str,
    name: &str,
) -> Result<RowGroups, GpuOpError> {
    let n = column.len;
    let words = equality_words(runtime, column, operator, name)?;
    let groups = row_groups(runtime, &words, column.validity.as_ref(), n)?;
    if column.data_type == DataType::Utf8 {
        check_string_groups(runtime, column, &groups, operator, name)?;
    }
    Ok(groups)
}

/// Checks that every valid row of a string column holds its group's first row's string.
fn check_string_groups(
    runtime: &GpuRuntime,
    column: &DeviceColumn,
    groups: &RowGroups,
    operator: &'static str,
    name: &str,
) -> Result<(), GpuOpError> {
    let n = column.len;
    let mismatches = filled_u32(runtime, 1, 0)?;
    run(
        runtime,
        "wrk_str_group_check",
        n,
        &[
            Arg::Buf(string_offsets(column, operator, name)?),
            Arg::Buf(&column.values),
            Arg::Opt(column.validity.as_ref()),
            Arg::Buf(&groups.row_group),
            Arg::Buf(&groups.first_row),
            Arg::Buf(&mismatches),
            Arg::I64(n as i64),
        ],
    )?;
    match exec::read_u32(runtime, &mismatches, 0)? {
        0 => Ok(()),
        rows => Err(hash_collision(operator, name, rows)),
    }
}

/// The refusal of an operator whose string key `name` has different strings with one hash.
pub(super) fn hash_collision(operator: &'static str, name: &str, rows: u32) -> GpuOpError {
    GpuOpError::Unsupported {
        operator,
        detail: format!(
            "{rows} row(s) of the string key `{name}` share a 64-bit hash with a different \
             string; the CPU backend compares them"
        ),
    }
}

/// Groups the rows by their `words`; see [`RowGroups`].
fn row_groups(
    runtime: &GpuRuntime,
    words: &super::pool::DeviceBuffer,
    validity: Option<&super::pool::DeviceBuffer>,
    n: usize,
) -> Result<RowGroups, GpuOpError> {
    let capacity = table_capacity(n);
    let slots = capacity + 1;
    let slot_words = alloc(runtime, capacity, 8)?;
    let slot_state = filled_u32(runtime, capacity, 0)?;
    let first_row = filled_u32(runtime, slots, NONE)?;
    let row_slot = alloc(runtime, n, 4)?;
    run(
        runtime,
        "wrk_group_insert",
        n,
        &[
            Arg::Buf(words),
            Arg::Opt(validity),
            Arg::Buf(&slot_words),
            Arg::Buf(&slot_state),
            Arg::Buf(&first_row),
            Arg::Buf(&row_slot),
            Arg::U64(capacity as u64 - 1),
            Arg::I64(n as i64),
        ],
    )?;
    let used_flags = alloc(runtime, slots, 4)?;
    run(
        runtime,
        "wrk_used_slots",
        slots,
        &[
            Arg::Buf(&first_row),
            Arg::Buf(&used_flags),
            Arg::I64(slots as i64),
        ],
    )?;
    let (used_slots, groups) = selected_rows(runtime, &used_flags, slots)?;
    // Number groups by first occurrence: sort the used slots by their first row.
    let first_words = alloc(runtime, groups, 8)?;
    run(
        runtime,
        "wrk_slot_first_rows",
        groups,
        &[
            Arg::Buf(&used_slots),
            Arg::Buf(&first_row),
            Arg::Buf(&first_words),
            Arg::I64(groups as i64),
        ],
    )?;
    let order = radix_sort(runtime, &first_words, iota(runtime, 0, groups)?, groups)?;
    let group_of_slot = alloc(runtime, slots, 4)?;
    let group_first_row = alloc(runtime, groups, 4)?;
    run(
        runtime,
        "wrk_number_groups",
        groups,
        &[
            Arg::Buf(&used_slots),
            Arg::Buf(&order),
            Arg::Buf(&first_row),
            Arg::Buf(&group_of_slot),
            Arg::Buf(&group_first_row),
            Arg::I64(groups as i64),
        ],
    )?;
    let row_group = alloc(runtime, n, 4)?;
    run(
        runtime,
        "wrk_row_groups",
        n,
        &[
            Arg::Buf(&row_slot),
            Arg::Buf(&group_of_slot),
            Arg::Buf(&row_group),
            Arg::I64(n as i64),
        ],
    )?;
    Ok(RowGroups {
        row_group,
        groups,
        first_row: group_first_row,
    })
}

/// The rows of `table` grouped by `keys` (at least one): one key's groups, then each row's
/// groups so far and its next key's group combined into one word, grouped again.
fn table_groups(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    keys: &[String],
    operator: &'static str,
) -> Result<RowGroups, GpuOpError> {
    let Some((first_key, other_keys)) = keys.split_first() else {
        return Err(GpuOpError::Invalid {
            operator,
            detail: "at least one key column is needed".into(),
        });
    };
    let n = table.rows;
    check_rows(n)?;
    let key_groups =
        |key: &String| key_groups(runtime, column_of(table, operator, key)?, operator, key);
    let mut grouped = key_groups(first_key)?;
    for key in other_keys {
        let next = key_groups(key)?;
        grouped = combine_groups(runtime, &grouped.row_group, &next, n)?;
    }
    Ok(grouped)
}

/// Rows grouped by the pair (their group so far, in `so_far`, and their group in `next`).
fn combine_groups(
    runtime: &GpuRuntime,
    so_far: &super::pool::DeviceBuffer,
    next: &RowGroups,
    n: usize,
) -> Result<RowGroups, GpuOpError> {
    let words = combined_words(runtime, so_far, next, n)?;
    row_groups(runtime, &words, None, n)
}

/// One word per row from its group so far and its group in `next`: distinct pairs make
/// distinct words.
fn combined_words(
    runtime: &GpuRuntime,
    so_far: &super::pool::DeviceBuffer,
    next: &RowGroups,
    n: usize,
) -> Result<super::pool::DeviceBuffer, GpuOpError> {
    let words = alloc(runtime, n, 8)?;
    run(
        runtime,
        "wrk_combine_groups",
        n,
        &[
            Arg::Buf(so_far),
            Arg::U64(next.groups as u64),
            Arg::Buf(&next.row_group),
            Arg::Buf(&words),
            Arg::I64(n as i64),
        ],
    )?;
    Ok(words)
}

/// One row per distinct combination of `columns` (every column when `None` or empty): the
/// first row of each, in order of first occurrence (as `cpu::ops::distinct`).
pub fn distinct(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    columns: Option<&[String]>,
) -> Result<DeviceTable, GpuOpError> {
    const OP: &str = "distinct";
    let all: Vec<String>;
    let keys = match columns {
        Some(names) if !names.is_empty() => names,
        _ => {
            all = table
                .schema
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect();
            &all
        }
    };
    if keys.is_empty() {
        // No columns: nothing to tell rows apart by (as the CPU backend, the table itself).
        return Ok(DeviceTable {
            schema: table.schema.clone(),
            columns: Vec::new(),
            rows: table.rows,
        });
    }
    let groups = table_groups(runtime, table, keys, OP)?;
    Ok(gather_table(
        runtime,
        table,
        &groups.first_row,
        groups.groups,
    )?)
}

/// Hash group-by on fixed-width and string key columns: the key columns, then one column per
/// aggregate; groups in order of first occurrence, nulls equal to each other (as the CPU
/// backend groups).
/// Several keys are grouped one at a time: the groups so far and the next key's groups make
/// one word per row (`group * next_groups + next_group`), grouped again.
pub fn group_by(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    keys: &[String],
    aggregates: &[Aggregate],
) -> Result<DeviceTable, GpuOpError> {
    const OP: &str = "group-by";
    let RowGroups {
        row_group,
        groups,
        first_row,
    } = table_groups(runtime, table, keys, OP)?;
    let mut fields = Vec::with_capacity(keys.len() + aggregates.len());
    let mut columns = Vec::with_capacity(keys.len() + aggregates.len());
    for key in keys {
        let index = column_index(table, OP, key)?;
        fields.push(table.schema.field(index).clone());
        columns.push(Arc::new(gather_column(
            runtime,
            &table.columns[index],
            &first_row,
            groups,
            false,
        )?));
    }
    for aggregate in aggregates {
        let values = column_of(table, OP, &aggregate.column)?;
        let column = aggregate_column(runtime, table, values, aggregate, &row_group, groups)?;
        fields.push(Field::new(&aggregate.alias, column.data_type.clone(), true));
        columns.push(Arc::new(column));
    }
    Ok(DeviceTable {
        schema: Arc::new(Schema::new(fields)),
        columns,
        rows: groups,
    })
}

fn aggregate_column(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    values: &DeviceColumn,
    aggregate: &Aggregate,
    row_group: &super::pool::DeviceBuffer,
    groups: usize,
) -> Result<DeviceColumn, GpuOpError> {
    const OP: &str = "group-by";
    let n = values.len;
    let counts = filled_u64(runtime, groups, 0)?;
    run_accumulate(
        runtime,
        "wrk_agg_count",
        n,
        groups,
        &[
            Arg::Opt(values.validity.as_ref()),
            Arg::Buf(row_group),
            Arg::Buf(&counts),
            Arg::I64(n as i64),
            Arg::I64(groups as i64),
        ],
    )?;
    let data_type = &values.data_type;
    let numeric = data_type.is_numeric();
    let function = aggregate.function;
    if function == AggregateFn::Count {
        return Ok(DeviceColumn {
            data_type: DataType::Int64,
            len: groups,
            values: counts,
            offsets: None,
            validity: None,
        });
    }
    if function == AggregateFn::CountDistinct {
        return count_distinct(runtime, values, &aggregate.column, row_group, groups);
    }
    if !numeric {
        return Err(GpuOpError::Unsupported {
            operator: OP,
            detail: format!(
                "{function:?} of `{}` ({data_type}) has no kernel yet",
                aggregate.column
            ),
        });
    }
    let valid = alloc(runtime, groups, 1)?;
    run(
        runtime,
        "wrk_count_valid",
        groups,
        &[Arg::Buf(&counts), Arg::Buf(&valid), Arg::I64(groups as i64)],
    )?;
    let suffix = storage_suffix(data_type).unwrap_or("f64");
    let float = data_type.is_floating();
    let unsigned = data_type.is_unsigned_integer();
    let column = |data_type: DataType, values| DeviceColumn {
        data_type,
        len: groups,
        values,
        offsets: None,
        validity: None,
    };
    // The min and max kernels also take their accumulators' start.
    let accumulate = |kernel: String,
                      source: &DeviceColumn,
                      acc: &super::pool::DeviceBuffer,
                      start: Option<u64>| {
        let mut args = vec![
            Arg::Buf(&source.values),
            Arg::Opt(source.validity.as_ref()),
            Arg::Buf(row_group),
            Arg::Buf(acc),
            Arg::I64(n as i64),
            Arg::I64(groups as i64),
        ];
        args.extend(start.map(Arg::U64));
        run_accumulate(runtime, &kernel, n, groups, &args)
    };
    match function {
        AggregateFn::Sum => {
            let acc = filled_u64(runtime, groups, 0)?;
            accumulate(format!("wrk_agg_sum_{suffix}"), values, &acc, None)?;
            let result_type = if float {
                DataType::Float64
            } else if unsigned {
                DataType::UInt64
            } else {
                DataType::Int64
            };
            Ok(DeviceColumn {
                validity: Some(valid),
                ..column(result_type, acc)
            })
        }
        AggregateFn::Mean => {
            // Means sum as f64 whatever the input (as the CPU backend does).
            let as_float = if *data_type == DataType::Float64 {
                None
            } else {
                let cast = Expr::Cast {
                    arg: Arc::new(Expr::col(aggregate.column.clone())),
                    to: DataType::Float64,
                };
                Some(evaluate(runtime, table, &cast)?)
            };
            let source = as_float.as_ref().unwrap_or(values);
            let sums = filled_u64(runtime, groups, 0)?;
            accumulate("wrk_agg_sum_f64".into(), source, &sums, None)?;
            let means = alloc(runtime, groups, 8)?;
            run(
                runtime,
                "wrk_agg_mean",
                groups,
                &[
                    Arg::Buf(&sums),
                    Arg::Buf(&counts),
                    Arg::Buf(&means),
                    Arg::Buf(&valid),
                    Arg::I64(groups as i64),
                ],
            )?;
            Ok(DeviceColumn {
                validity: Some(valid),
                ..column(DataType::Float64, means)
            })
        }
        _ => {
            let min = function == AggregateFn::Min;
            let start = match (float, unsigned, min) {
                (true, _, _) => f64::NAN.to_bits(),
                (false, true, true) => u64::MAX,
                (false, true, false) => 0,
                (false, false, true) => i64::MAX as u64,
                (false, false, false) => i64::MIN as u64,
            };
            let acc = filled_u64(runtime, groups, start)?;
            let which = if min { "min" } else { "max" };
            accumulate(
                format!("wrk_agg_{which}_{suffix}"),
                values,
                &acc,
                Some(start),
            )?;
            // The result has the input's type (as the CPU backend casts it back).
            let width = value_width(data_type).unwrap_or(8);
            let out = if width == 8 {
                acc
            } else {
                let narrow = alloc(runtime, groups, width)?;
                run(
                    runtime,
                    &format!("wrk_narrow_{suffix}"),
                    groups,
                    &[Arg::Buf(&acc), Arg::Buf(&narrow), Arg::I64(groups as i64)],
                )?;
                narrow
            };
            Ok(DeviceColumn {
                validity: Some(valid),
                ..column(data_type.clone(), out)
            })
        }
    }
}

/// The number of distinct valid values of `values` in each of `groups` groups (`row_group`
/// being each row's): the rows are grouped by (group, value), and each such pair with a valid
/// value counts one for its group. Values compare as group-by keys do (floats by their bits,
/// as Arrow's row format compares them in the CPU backend).
fn count_distinct(
    runtime: &GpuRuntime,
    values: &DeviceColumn,
    name: &str,
    row_group: &super::pool::DeviceBuffer,
    groups: usize,
) -> Result<DeviceColumn, GpuOpError> {
    const OP: &str = "group-by";
    let n = values.len;
    let value_groups = key_groups(runtime, values, OP, name)?;
    let pairs = combine_groups(runtime, row_group, &value_groups, n)?;
    let counts = filled_u64(runtime, groups, 0)?;
    run(
        runtime,
        "wrk_count_distinct",
        pairs.groups,
        &[
            Arg::Buf(&pairs.first_row),
            Arg::Opt(values.validity.as_ref()),
            Arg::Buf(row_group),
            Arg::Buf(&counts),
            Arg::I64(pairs.groups as i64),
        ],
    )?;
    Ok(DeviceColumn {
        data_type: DataType::Int64,
        len: groups,
        values: counts,
        offsets: None,
        validity: None,
    })
}

/// Whether two key types compare by their equality words as the CPU backend compares them.
fn joinable(left: &DataType, right: &DataType) -> bool {
    use DataType::*;
    let int_like =
        |t: &DataType| matches!(t, Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32);
    (left == right && key_type_covered(left))
        || (int_like(left) && int_like(right))
        || (left.is_floating() && right.is_floating())
}

/// Joins `left` with `right` on `left_on = right_on`. The index is built on `right`; with one
/// key each and `cache_index` (a table the worker's tasks share) it comes from, or goes to,
/// the worker's cache (`join_index`). Several keys are joined on the words of
/// [`joint_key_columns`].
pub fn join(
    runtime: &GpuRuntime,
    left: &DeviceTable,
    right: &DeviceTable,
    left_on: &[String],
    right_on: &[String],
    how: JoinType,
    cache_index: bool,
) -> Result<DeviceTable, GpuOpError> {
    const OP: &str = "join";
    if left_on.len() != right_on.len() || left_on.is_empty() {
        return Err(GpuOpError::Invalid {
            operator: OP,
            detail: format!(
                "{} left and {} right key columns (they pair up, at least one each)",
                left_on.len(),
                right_on.len()
            ),
        });
    }
    for (left_key, right_key) in left_on.iter().zip(right_on) {
        let (l, r) = (
            column_of(left, OP, left_key)?,
            column_of(right, OP, right_key)?,
        );
        if !joinable(&l.data_type, &r.data_type) {
            return Err(GpuOpError::Unsupported {
                operator: OP,
                detail: format!(
                    "keys `{left_key}` and `{right_key}` of types {} and {} have no kernel yet",
                    l.data_type, r.data_type
                ),
            });
        }
    }
    let n = left.rows;
    check_rows(n)?;
    check_rows(right.rows)?;
    let joint;
    let (lk, rk, left_key, right_key) = match (left_on, right_on) {
        ([left_key], [right_key]) => (
            column_of(left, OP, left_key)?,
            column_of(right, OP, right_key)?,
            left_key.as_str(),
            right_key.as_str(),
        ),
        _ => {
            joint = joint_key_columns(runtime, left, right, left_on, right_on)?;
            (&joint.0, &joint.1, "the left keys", "the right keys")
        }
    };
    let cache_index = cache_index && right_on.len() == 1;
    let left_words = equality_words(runtime, lk, OP, left_key)?;
    let build = || {
        JoinIndex::build(
            runtime,
            rk,
            &equality_words(runtime, rk, OP, right_key)?,
            right_key,
        )
    };
    let index = if cache_index {
        let key = &right.columns[column_index(right, OP, &right_on[0])?];
        runtime.join_indexes.get_or_build(key, build)?
    } else {
        Arc::new(build()?)
    };
    let (match_start, match_count) =
        index.probe(runtime, (lk, left_key), &left_words, (rk, right_key))?;
    if matches!(how, JoinType::Semi | JoinType::Anti) {
        let flags = alloc(runtime, n, 4)?;
        run(
            runtime,
            "wrk_match_flags",
            n,
            &[
                Arg::Buf(&match_count),
                Arg::I32(i32::from(how == JoinType::Semi)),
                Arg::Buf(&flags),
                Arg::I64(n as i64),
            ],
        )?;
        let (indices, m) = selected_rows(runtime, &flags, n)?;
        return Ok(gather_table(runtime, left, &indices, m)?);
    }
    let keep_unmatched = i32::from(how == JoinType::Left);
    let out_counts = alloc(runtime, n, 4)?;
    run(
        runtime,
        "wrk_join_out_counts",
        n,
        &[
            Arg::Buf(&match_count),
            Arg::I32(keep_unmatched),
            Arg::Buf(&out_counts),
            Arg::I64(n as i64),
        ],
    )?;
    let (out_pos, m) = exec::exclusive_scan(runtime, &out_counts, n)?;
    let m = m as usize;
    let probe_rows = alloc(runtime, m, 4)?;
    let build_out = alloc(runtime, m, 4)?;
    run(
        runtime,
        "wrk_join_emit",
        n,
        &[
            Arg::Buf(&match_start),
            Arg::Buf(&match_count),
            Arg::Buf(&out_pos),
            Arg::Buf(&index.build_order),
            Arg::I32(keep_unmatched),
            Arg::Buf(&probe_rows),
            Arg::Buf(&build_out),
            Arg::I64(n as i64),
        ],
    )?;
    let left_part = gather_table(runtime, left, &probe_rows, m)?;
    let mut fields = owned_fields(left_part.schema.fields());
    let mut columns = left_part.columns;
    let mut taken: Vec<String> = fields.iter().map(|f| f.name().clone()).collect();
    let unmatched = how == JoinType::Left;
    for (field, column) in right.schema.fields().iter().zip(&right.columns) {
        if right_on.contains(field.name()) {
            continue;
        }
        let mut name = field.name().clone();
        while taken.contains(&name) {
            name = format!("{name}_right");
        }
        taken.push(name.clone());
        fields.push(Field::new(
            name,
            field.data_type().clone(),
            field.is_nullable() || unmatched,
        ));
        columns.push(Arc::new(gather_column(
            runtime, column, &build_out, m, unmatched,
        )?));
    }
    Ok(DeviceTable {
        schema: Arc::new(Schema::new(fields)),
        columns,
        rows: m,
    })
}

/// The key tuples of a join on several keys as one `UInt64` column per table (its words), null
/// where any key is null (such a row matches nothing). Equal tuples get equal words on both
/// sides because the two tables' keys are grouped together: each key pair's values, left rows
/// then right rows, are grouped (strings by checked hashes, see [`key_groups`]), and each
/// row's groups so far and its next key's group make the next word, as in [`group_by`].
fn joint_key_columns(
    runtime: &GpuRuntime,
    left: &DeviceTable,
    right: &DeviceTable,
    left_on: &[String],
    right_on: &[String],
) -> Result<(DeviceColumn, DeviceColumn), GpuOpError> {
    const OP: &str = "join";
    let (n_left, n_right) = (left.rows, right.rows);
    let n = n_left + n_right;
    // The rows of both tables are grouped as one: their indices must fit too.
    check_rows(n)?;
    let pairs: Vec<(&String, &String)> = left_on.iter().zip(right_on).collect();
    let Some(((last_left, last_right), first_pairs)) = pairs.split_last() else {
        return Err(GpuOpError::Invalid {
            operator: OP,
            detail: "no key columns".into(),
        });
    };
    let Some(((first_left, first_right), middle_pairs)) = first_pairs.split_first() else {
        return Err(GpuOpError::Invalid {
            operator: OP,
            detail: "joint keys need at least two key pairs".into(),
        });
    };
    // A row is null when any of its keys is.
    let mut valid: Option<super::pool::DeviceBuffer> = None;
    let mut pair_groups = |left_key: &String, right_key: &String| {
        let pair = [
            column_of(left, OP, left_key)?,
            column_of(right, OP, right_key)?,
        ];
        let (groups, pair_validity) = if pair[0].data_type == DataType::Utf8 {
            let both = concat_column(runtime, &pair, n)?;
            (key_groups(runtime, &both, OP, left_key)?, both.validity)
        } else {
            let validity = concat_validity(runtime, &pair, n)?;
            let mut both = alloc(runtime, n, 8)?;
            let left_words = equality_words(runtime, pair[0], OP, left_key)?;
            copy_into(runtime, &left_words, n_left * 8, &mut both, 0)?;
            let right_words = equality_words(runtime, pair[1], OP, right_key)?;
            copy_into(runtime, &right_words, n_right * 8, &mut both, n_left * 8)?;
            (row_groups(runtime, &both, validity.as_ref(), n)?, validity)
        };
        if let Some(pair_validity) = &pair_validity {
            let all = match valid.take() {
                Some(all) => all,
                None => filled_u8(runtime, n, 1)?,
            };
            run(
                runtime,
                "wrk_valid_and",
                n,
                &[Arg::Buf(pair_validity), Arg::Buf(&all), Arg::I64(n as i64)],
            )?;
            valid = Some(all);
        }
        Ok::<_, GpuOpError>(groups)
    };
    let mut so_far = pair_groups(first_left, first_right)?;
    for (left_key, right_key) in middle_pairs {
        let next = pair_groups(left_key, right_key)?;
        so_far = combine_groups(runtime, &so_far.row_group, &next, n)?;
    }
    // The last pair's combined words are the join's words: grouping them again would only
    // renumber them.
    let last = pair_groups(last_left, last_right)?;
    let words = combined_words(runtime, &so_far.row_group, &last, n)?;
    let joint = DeviceColumn {
        data_type: DataType::UInt64,
        len: n,
        values: words,
        offsets: None,
        validity: valid,
    };
    let side = |start: usize, rows: usize| -> Result<DeviceColumn, GpuOpError> {
        let indices = iota(runtime, start as u32, rows)?;
        Ok(gather_column(runtime, &joint, &indices, rows, false)?)
    };
    Ok((side(0, n_left)?, side(n_left, n_right)?))
}

/// The rows of `tables` one after the other (same column names and types).
pub fn concat(runtime: &GpuRuntime, tables: &[&DeviceTable]) -> Result<DeviceTable, GpuOpError> {
    const OP: &str = "concat";
    let Some(first) = tables.first() else {
        return Err(GpuOpError::Invalid {
            operator: OP,
            detail: "no tables to concatenate".into(),
        });
    };
    for (i, t) in tables.iter().enumerate().skip(1) {
        let same = t.schema.fields().len() == first.schema.fields().len()
            && t.schema
                .fields()
                .iter()
                .zip(first.schema.fields())
                .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
        if !same {
            return Err(GpuOpError::Invalid {
                operator: OP,
                detail: format!("table {i} has other columns than table 0"),
            });
        }
    }
    let rows: usize = tables.iter().map(|t| t.rows).sum();
    check_rows(rows)?;
    let mut columns = Vec::with_capacity(first.columns.len());
    for c in 0..first.columns.len() {
        let parts: Vec<&DeviceColumn> = tables.iter().map(|t| t.columns[c].as_ref()).collect();
        columns.push(Arc::new(concat_column(runtime, &parts, rows)?));
    }
    let fields: Vec<Field> = first
        .schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let nullable = tables.iter().any(|t| t.schema.field(i).is_nullable());
            f.as_ref().clone().with_nullable(nullable)
        })
        .collect();
    Ok(DeviceTable {
        schema: Arc::new(Schema::new(fields)),
        columns,
        rows,
    })
}

/// Copies `bytes` bytes of `src` to `dst` at byte `at`.
fn copy_into(
    runtime: &GpuRuntime,
    src: &super::pool::DeviceBuffer,
    bytes: usize,
    dst: &mut super::pool::DeviceBuffer,
    at: usize,
) -> Result<(), GpuOpError> {
    if bytes == 0 {
        return Ok(());
    }
    runtime
        .backend
        .copy(src.memory(), bytes, dst.memory_mut(), at)
        .map_err(TableError::Copy)?;
    Ok(())
}

/// The validity of `parts` one after the other (`rows` in all), or `None` when no part has
/// nulls.
fn concat_validity(
    runtime: &GpuRuntime,
    parts: &[&DeviceColumn],
    rows: usize,
) -> Result<Option<super::pool::DeviceBuffer>, GpuOpError> {
    if parts.iter().all(|p| p.validity.is_none()) {
        return Ok(None);
    }
    let mut out = alloc(runtime, rows, 1)?;
    let mut at = 0;
    for p in parts {
        match &p.validity {
            Some(v) => copy_into(runtime, v, p.len, &mut out, at)?,
            None => {
                let ones = filled_u8(runtime, p.len, 1)?;
                copy_into(runtime, &ones, p.len, &mut out, at)?;
            }
        }
        at += p.len;
    }
    Ok(Some(out))
}

fn concat_column(
    runtime: &GpuRuntime,
    parts: &[&DeviceColumn],
    rows: usize,
) -> Result<DeviceColumn, GpuOpError> {
    let data_type = parts[0].data_type.clone();
    let validity = concat_validity(runtime, parts, rows)?;
    let (values, offsets) = if data_type == DataType::Utf8 {
        let mut lengths = Vec::with_capacity(parts.len());
        for p in parts {
            let offsets = p.offsets.as_ref().ok_or_else(|| GpuOpError::Invalid {
                operator: "concat",
                detail: "a string column without offsets".into(),
            })?;
            lengths.push(exec::read_i32(runtime, offsets, p.len)?.max(0) as usize);
        }
        let total: usize = lengths.iter().sum();
        if i32::try_from(total).is_err() {
            return Err(GpuOpError::Unsupported {
                operator: "concat",
                detail: format!("{total} bytes of strings exceed 32-bit offsets"),
            });
        }
        let mut bytes = alloc(runtime, total, 1)?;
        let offsets = alloc(runtime, rows + 1, 4)?;
        let (mut at_bytes, mut at_rows) = (0usize, 0usize);
        for (p, &len) in parts.iter().zip(&lengths) {
            copy_into(runtime, &p.values, len, &mut bytes, at_bytes)?;
            if let Some(src) = &p.offsets {
                run(
                    runtime,
                    "wrk_offsets_shift",
                    p.len + 1,
                    &[
                        Arg::Buf(src),
                        Arg::I32(at_bytes as i32),
                        Arg::At(&offsets, (at_rows * 4) as u64),
                        Arg::I64(p.len as i64 + 1),
                    ],
                )?;
            }
            at_bytes += len;
            at_rows += p.len;
        }
        (bytes, Some(offsets))
    } else {
        let width = value_width(&data_type).unwrap_or(1);
        let mut values = alloc(
            runtime,
            if data_type == DataType::Null { 0 } else { rows },
            width,
        )?;
        let mut at = 0;
        if data_type != DataType::Null {
            for p in parts {
                copy_into(runtime, &p.values, p.len * width, &mut values, at)?;
                at += p.len * width;
            }
        }
        (values, None)
    };
    Ok(DeviceColumn {
        data_type,
        len: rows,
        values,
        offsets,
        validity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::table::upload;
    use arrow::array::{ArrayRef, RecordBatch, StringArray};

    #[test]
    fn a_string_hash_collision_is_never_taken_for_equal_keys() {
        let Some(runtime) = super::super::test_device("a_string_hash_collision") else {
            return;
        };
        let strings = |values: &[&str]| {
            let column = Arc::new(StringArray::from(values.to_vec())) as ArrayRef;
            upload(
                &runtime,
                &RecordBatch::try_from_iter([("s", column)]).unwrap(),
            )
            .unwrap()
        };
        // Words all equal: what the kernels would see if every string had one hash.
        let colliding = |rows| filled_u64(&runtime, rows, 7).unwrap();
        let mixed = strings(&["a", "b", "a"]);
        let key = mixed.columns[0].as_ref();

        // A group-by: the words make one group; the check refuses it.
        let groups = row_groups(&runtime, &colliding(3), None, 3).unwrap();
        assert_eq!(groups.groups, 1);
        let refused = check_string_groups(&runtime, key, &groups, "group-by", "s").unwrap_err();
        assert!(
            matches!(refused, GpuOpError::Unsupported { .. })
                && refused
                    .to_string()
                    .contains("1 row(s) of the string key `s`"),
            "{refused}"
        );
        // With the real hashes: two groups, checked.
        assert_eq!(
            key_groups(&runtime, key, "group-by", "s").unwrap().groups,
            2
        );

        // A join build: a run of different strings is refused (a, b, a: two neighbours
        // differ); a run of equal strings is one key.
        let refused = JoinIndex::build(&runtime, key, &colliding(3), "s")
            .err()
            .unwrap();
        assert!(refused.to_string().contains("2 row(s)"), "{refused}");
        let same = strings(&["a", "a"]);
        let build_key = same.columns[0].as_ref();
        let index = JoinIndex::build(&runtime, build_key, &colliding(2), "s").unwrap();
        assert_eq!(index.runs, 1);
        // A probe: `b` finds the run by its word, and no match in it.
        let (_, counts) = index
            .probe(&runtime, (key, "s"), &colliding(3), (build_key, "s"))
            .unwrap();
        let counts: Vec<u32> = to_host(&runtime, &counts, 12)
            .unwrap()
            .chunks(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(counts, [2, 0, 2]);
    }

    #[test]
    fn join_keys_pair_as_the_cpu_compares_them() {
        assert!(joinable(&DataType::Int32, &DataType::Int64));
        assert!(joinable(&DataType::UInt32, &DataType::Int8));
        assert!(joinable(&DataType::UInt64, &DataType::UInt64));
        assert!(joinable(&DataType::Float32, &DataType::Float64));
        assert!(joinable(&DataType::Date32, &DataType::Date32));
        assert!(!joinable(&DataType::UInt64, &DataType::Int64));
        assert!(!joinable(&DataType::Int64, &DataType::Float64));
        assert!(joinable(&DataType::Utf8, &DataType::Utf8));
        assert!(!joinable(&DataType::Utf8, &DataType::Int64));
        assert!(!joinable(&DataType::LargeUtf8, &DataType::LargeUtf8));

        let schema = |fields: &[(&str, DataType)]| {
            Schema::new(
                fields
                    .iter()
                    .map(|(name, t)| Field::new(*name, t.clone(), true))
                    .collect::<Vec<_>>(),
            )
        };
        let left = schema(&[("a", DataType::Int32), ("b", DataType::Utf8)]);
        let right = schema(&[("x", DataType::Int64), ("y", DataType::Utf8)]);
        let keys = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert!(join_covers(
            &left,
            &right,
            &keys(&["a", "b"]),
            &keys(&["x", "y"])
        ));
        assert!(!join_covers(
            &left,
            &right,
            &keys(&["a", "b"]),
            &keys(&["y", "x"])
        ));
        assert!(!join_covers(
            &left,
            &right,
            &keys(&["a"]),
            &keys(&["x", "y"])
        ));
        assert!(!join_covers(&left, &right, &[], &[]));
    }

    #[test]
    fn every_storage_suffix_names_fixed_kernels() {
        let source = super::super::kernels::FIXED_SOURCE;
        for t in [
            DataType::Int8,
            DataType::Int16,
            DataType::Int32,
            DataType::Int64,
            DataType::UInt8,
            DataType::UInt16,
            DataType::UInt32,
            DataType::UInt64,
            DataType::Float32,
            DataType::Float64,
            DataType::Boolean,
            DataType::Date32,
        ] {
            let suffix = storage_suffix(&t).unwrap();
            for prefix in ["wrk_hash_", "wrk_eq_word_", "wrk_order_word_"] {
                let name = format!("{prefix}{suffix},");
                assert!(source.contains(&name), "{name} missing for {t}");
            }
            for prefix in ["wrk_agg_sum_", "wrk_agg_min_", "wrk_agg_max_"] {
                let name = format!("{prefix}##suffix");
                assert!(source.contains(&name), "{name}");
                assert!(
                    source.contains(&format!("WRK_AGG_KERNELS({suffix},"))
                        || t == DataType::Boolean
                        || t == DataType::Date32,
                    "aggregates of {t}"
                );
            }
        }
        assert_eq!(table_capacity(0), 16);
        assert_eq!(table_capacity(100), 256);
    }
}
