//! The `dataframe` interface: `expr`, `column` and `table` handles, their operators run on the
//! GPU or the CPU backend (see [`super::dispatch`]).

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float64Array, Int64Array, StringArray, UInt64Array,
};
use arrow::buffer::NullBuffer;
use arrow::datatypes::{
    DataType as ArrowType, Field as ArrowField, Float64Type, Int64Type, Schema, TimeUnit,
    UInt64Type,
};
use arrow::record_batch::RecordBatch;
use wasmtime::component::Resource;

use super::bindings::wrk::task::dataframe::{Host, HostColumn, HostExpr, HostTable};
use super::dispatch::{DeviceOp, Placed};
use super::wit::{
    Aggregate, AggregateOp, BinaryOp, ColumnValues, DataType, Error, ErrorCode, Field, JoinType,
    Scalar, SortKey, UnaryOp, Values,
};
use super::{ExprHandle, TaskState, TaskTable, error};
use crate::cpu::{dictionary, eval, join, ops, partition, sort};
use crate::expr::{Expr, ExprError, Literal};
use crate::gpu::ops as gpu_ops;
use crate::gpu::table::download_array;
use crate::table::{Column, Table, decode_ipc, encode_ipc};

impl Host for TaskState {}

/// The WIT type of an Arrow type. Types the contract does not name yet are reported as their
/// closest relative (any timestamp as `timestamp-us`, large strings as `utf8`).
pub(crate) fn wit_type(data_type: &ArrowType) -> DataType {
    match data_type {
        ArrowType::Boolean => DataType::Boolean,
        ArrowType::Int8 => DataType::Int8,
        ArrowType::Int16 => DataType::Int16,
        ArrowType::Int32 => DataType::Int32,
        ArrowType::Int64 => DataType::Int64,
        ArrowType::UInt8 => DataType::Uint8,
        ArrowType::UInt16 => DataType::Uint16,
        ArrowType::UInt32 => DataType::Uint32,
        ArrowType::UInt64 => DataType::Uint64,
        ArrowType::Float16 | ArrowType::Float32 => DataType::Float32,
        ArrowType::Float64 => DataType::Float64,
        ArrowType::Date32 | ArrowType::Date64 => DataType::Date32,
        ArrowType::Timestamp(_, _) => DataType::TimestampUs,
        ArrowType::Dictionary(_, values) => wit_type(values),
        _ => DataType::Utf8,
    }
}

pub(crate) fn arrow_type(data_type: DataType) -> ArrowType {
    match data_type {
        DataType::Boolean => ArrowType::Boolean,
        DataType::Int8 => ArrowType::Int8,
        DataType::Int16 => ArrowType::Int16,
        DataType::Int32 => ArrowType::Int32,
        DataType::Int64 => ArrowType::Int64,
        DataType::Uint8 => ArrowType::UInt8,
        DataType::Uint16 => ArrowType::UInt16,
        DataType::Uint32 => ArrowType::UInt32,
        DataType::Uint64 => ArrowType::UInt64,
        DataType::Float32 => ArrowType::Float32,
        DataType::Float64 => ArrowType::Float64,
        DataType::Utf8 => ArrowType::Utf8,
        DataType::Date32 => ArrowType::Date32,
        DataType::TimestampUs => ArrowType::Timestamp(TimeUnit::Microsecond, None),
    }
}

fn expr_error(e: ExprError) -> Error {
    let code = match e {
        ExprError::UnknownColumn { .. } => ErrorCode::UnknownColumn,
        ExprError::TypeMismatch { .. } => ErrorCode::TypeMismatch,
        ExprError::Evaluation { .. } => ErrorCode::InvalidArgument,
    };
    error(code, e.to_string())
}

fn op_error(e: ops::OpError) -> Error {
    match e {
        ops::OpError::Expr(e) => expr_error(e),
        ops::OpError::UnknownColumn { .. } => error(ErrorCode::UnknownColumn, e.to_string()),
        ops::OpError::Invalid { .. } => error(ErrorCode::InvalidArgument, e.to_string()),
        ops::OpError::Arrow { .. } => error(ErrorCode::Internal, e.to_string()),
    }
}

impl TaskState {
    fn push_expr(&mut self, expr: Expr) -> wasmtime::Result<Resource<ExprHandle>> {
        Ok(self.table.push(ExprHandle(Arc::new(expr)))?)
    }

    fn expr(&self, handle: &Resource<ExprHandle>) -> wasmtime::Result<Arc<Expr>> {
        Ok(self.table.get(handle)?.0.clone())
    }

    /// Stores an operator's result as a new table handle, or passes its error to the guest.
    fn table_result(
        &mut self,
        result: Result<RecordBatch, Error>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        match result {
            Ok(batch) => self.push_table(batch),
            Err(e) => Ok(Err(e)),
        }
    }
}

impl HostExpr for TaskState {
    fn col(&mut self, name: String) -> wasmtime::Result<Resource<ExprHandle>> {
        self.push_expr(Expr::Column(name))
    }

    fn lit(&mut self, value: Scalar) -> wasmtime::Result<Resource<ExprHandle>> {
        let literal = match value {
            Scalar::Null => Literal::Null,
            Scalar::Boolean(v) => Literal::Boolean(v),
            Scalar::Int64(v) => Literal::Int64(v),
            Scalar::Uint64(v) => Literal::UInt64(v),
            Scalar::Float64(v) => Literal::Float64(v),
            Scalar::Utf8(v) => Literal::Utf8(v),
        };
        self.push_expr(Expr::Literal(literal))
    }

    fn binary(
        &mut self,
        op: BinaryOp,
        lhs: Resource<ExprHandle>,
        rhs: Resource<ExprHandle>,
    ) -> wasmtime::Result<Resource<ExprHandle>> {
        let (lhs, rhs) = (self.expr(&lhs)?, self.expr(&rhs)?);
        self.push_expr(Expr::Binary { op, lhs, rhs })
    }

    fn unary(
        &mut self,
        op: UnaryOp,
        arg: Resource<ExprHandle>,
    ) -> wasmtime::Result<Resource<ExprHandle>> {
        let arg = self.expr(&arg)?;
        self.push_expr(Expr::Unary { op, arg })
    }

    fn cast(
        &mut self,
        arg: Resource<ExprHandle>,
        to: DataType,
    ) -> wasmtime::Result<Resource<ExprHandle>> {
        let arg = self.expr(&arg)?;
        self.push_expr(Expr::Cast {
            arg,
            to: arrow_type(to),
        })
    }

    fn fill_null(
        &mut self,
        arg: Resource<ExprHandle>,
        fill: Resource<ExprHandle>,
    ) -> wasmtime::Result<Resource<ExprHandle>> {
        let (arg, fill) = (self.expr(&arg)?, self.expr(&fill)?);
        self.push_expr(Expr::FillNull { arg, fill })
    }

    fn if_else(
        &mut self,
        condition: Resource<ExprHandle>,
        then: Resource<ExprHandle>,
        otherwise: Resource<ExprHandle>,
    ) -> wasmtime::Result<Resource<ExprHandle>> {
        let condition = self.expr(&condition)?;
        let then = self.expr(&then)?;
        let otherwise = self.expr(&otherwise)?;
        self.push_expr(Expr::IfElse {
            condition,
            then,
            otherwise,
        })
    }

    fn to_string(&mut self, self_: Resource<ExprHandle>) -> wasmtime::Result<String> {
        Ok(self.expr(&self_)?.to_string())
    }

    fn drop(&mut self, rep: Resource<ExprHandle>) -> wasmtime::Result<()> {
        self.table.delete(rep)?;
        Ok(())
    }
}

/// Copies an Arrow array into guest values.
fn to_values(array: &ArrayRef) -> Result<ColumnValues, String> {
    let array = &dictionary::plain(array).map_err(|e| e.to_string())?;
    let validity = array
        .nulls()
        .map(|nulls| nulls.iter().collect::<Vec<bool>>());
    let cast = |to: &ArrowType| arrow::compute::cast(array, to).map_err(|e| e.to_string());
    let values = match array.data_type() {
        ArrowType::Boolean => Values::Boolean(
            array
                .as_boolean()
                .iter()
                .map(|v| v.unwrap_or(false))
                .collect(),
        ),
        t if t.is_unsigned_integer() => Values::Uint64(
            cast(&ArrowType::UInt64)?
                .as_primitive::<UInt64Type>()
                .values()
                .to_vec(),
        ),
        t if t.is_integer() => Values::Int64(
            cast(&ArrowType::Int64)?
                .as_primitive::<Int64Type>()
                .values()
                .to_vec(),
        ),
        t if t.is_floating() => Values::Float64(
            cast(&ArrowType::Float64)?
                .as_primitive::<Float64Type>()
                .values()
                .to_vec(),
        ),
        ArrowType::Date32 | ArrowType::Date64 | ArrowType::Timestamp(_, _) => {
            let ints = arrow::compute::cast(&cast(&ArrowType::Int64)?, &ArrowType::Int64)
                .map_err(|e| e.to_string())?;
            Values::Int64(ints.as_primitive::<Int64Type>().values().to_vec())
        }
        _ => {
            let strings = cast(&ArrowType::Utf8)?;
            Values::Utf8(
                strings
                    .as_string::<i32>()
                    .iter()
                    .map(|v| v.unwrap_or_default().to_string())
                    .collect(),
            )
        }
    };
    Ok(ColumnValues { values, validity })
}

fn values_len(values: &Values) -> usize {
    match values {
        Values::Boolean(v) => v.len(),
        Values::Int64(v) => v.len(),
        Values::Uint64(v) => v.len(),
        Values::Float64(v) => v.len(),
        Values::Utf8(v) => v.len(),
    }
}

/// Bytes a guest value list occupies, for the copy statistics.
fn values_bytes(values: &ColumnValues) -> u64 {
    let data = match &values.values {
        Values::Boolean(v) => v.len(),
        Values::Int64(v) => v.len() * 8,
        Values::Uint64(v) => v.len() * 8,
        Values::Float64(v) => v.len() * 8,
        Values::Utf8(v) => v.iter().map(|s| s.len() + 8).sum(),
    };
    (data + values.validity.as_ref().map_or(0, Vec::len)) as u64
}

/// Builds an Arrow array from guest values.
fn from_values(name: &str, values: ColumnValues) -> Result<ArrayRef, Error> {
    let len = values_len(&values.values);
    let nulls = match values.validity {
        Some(validity) if validity.len() != len => {
            return Err(error(
                ErrorCode::InvalidArgument,
                format!(
                    "column `{name}`: {} validity entries for {len} values",
                    validity.len()
                ),
            ));
        }
        Some(validity) => Some(NullBuffer::from(validity)),
        None => None,
    };
    let array: ArrayRef = match values.values {
        Values::Boolean(v) => Arc::new(BooleanArray::new(v.into(), nulls)),
        Values::Int64(v) => Arc::new(Int64Array::new(v.into(), nulls)),
        Values::Uint64(v) => Arc::new(UInt64Array::new(v.into(), nulls)),
        Values::Float64(v) => Arc::new(Float64Array::new(v.into(), nulls)),
        Values::Utf8(v) => {
            let strings = StringArray::from(v);
            Arc::new(StringArray::new(
                strings.offsets().clone(),
                strings.values().clone(),
                nulls,
            ))
        }
    };
    Ok(array)
}

impl HostColumn for TaskState {
    fn name(&mut self, self_: Resource<Column>) -> wasmtime::Result<String> {
        Ok(self.table.get(&self_)?.name.clone())
    }

    fn data_type(&mut self, self_: Resource<Column>) -> wasmtime::Result<DataType> {
        Ok(wit_type(self.table.get(&self_)?.array.data_type()))
    }

    fn len(&mut self, self_: Resource<Column>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&self_)?.array.len() as u64)
    }

    fn null_count(&mut self, self_: Resource<Column>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&self_)?.array.null_count() as u64)
    }

    fn to_values(
        &mut self,
        self_: Resource<Column>,
    ) -> wasmtime::Result<Result<ColumnValues, Error>> {
        let column = self.table.get(&self_)?;
        match to_values(&column.array) {
            Ok(values) => {
                self.copies.into_guest_bytes += values_bytes(&values);
                Ok(Ok(values))
            }
            Err(detail) => Ok(Err(error(
                ErrorCode::Internal,
                format!("copying column `{}` into the guest: {detail}", column.name),
            ))),
        }
    }

    fn from_values(
        &mut self,
        name: String,
        values: ColumnValues,
    ) -> wasmtime::Result<Result<Resource<Column>, Error>> {
        self.copies.out_of_guest_bytes += values_bytes(&values);
        match from_values(&name, values) {
            Ok(array) => self.push_column(name, array),
            Err(e) => Ok(Err(e)),
        }
    }

    fn rename(
        &mut self,
        self_: Resource<Column>,
        name: String,
    ) -> wasmtime::Result<Resource<Column>> {
        let array = self.table.get(&self_)?.array.clone();
        Ok(self.table.push(Column::new(name, array))?)
    }

    fn drop(&mut self, rep: Resource<Column>) -> wasmtime::Result<()> {
        self.table.delete(rep)?;
        Ok(())
    }
}

fn host_aggregates(aggregates: Vec<Aggregate>) -> Vec<ops::Aggregate> {
    aggregates
        .into_iter()
        .map(|a| ops::Aggregate {
            column: a.column,
            function: aggregate_fn(a.op),
            alias: a.alias,
        })
        .collect()
}

fn aggregate_fn(op: AggregateOp) -> ops::AggregateFn {
    match op {
        AggregateOp::Sum => ops::AggregateFn::Sum,
        AggregateOp::Count => ops::AggregateFn::Count,
        AggregateOp::Mean => ops::AggregateFn::Mean,
        AggregateOp::Min => ops::AggregateFn::Min,
        AggregateOp::Max => ops::AggregateFn::Max,
        AggregateOp::CountDistinct => ops::AggregateFn::CountDistinct,
    }
}

fn sort_keys(keys: Vec<SortKey>) -> Vec<sort::SortKey> {
    keys.into_iter()
        .map(|k| sort::SortKey {
            column: k.column,
            descending: k.descending,
            nulls_first: k.nulls_first,
        })
        .collect()
}

impl HostTable for TaskState {
    fn from_columns(
        &mut self,
        columns: Vec<Resource<Column>>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let columns = columns
            .iter()
            .map(|c| Ok(self.table.get(c)?.clone()))
            .collect::<wasmtime::Result<Vec<Column>>>()?;
        let fields: Vec<ArrowField> = columns
            .iter()
            .map(|c| {
                ArrowField::new(
                    &c.name,
                    c.array.data_type().clone(),
                    c.array.null_count() > 0,
                )
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = columns.iter().find(|c| !seen.insert(c.name.as_str())) {
            return Ok(Err(error(
                ErrorCode::InvalidArgument,
                format!("from-columns: column `{}` appears twice", dup.name),
            )));
        }
        let arrays = columns.into_iter().map(|c| c.array).collect();
        let result = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)
            .map_err(|e| error(ErrorCode::InvalidArgument, format!("from-columns: {e}")));
        self.table_result(result)
    }

    fn concat(
        &mut self,
        tables: Vec<Resource<TaskTable>>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        // One table is its own concatenation: a new handle on it, with no copy, and a
        // broadcast input stays shared (joins keep using the worker's index on it).
        if let [only] = tables.as_slice() {
            let table = self.table.get(only)?.clone();
            return Ok(Ok(self.table.push(table)?));
        }
        let inputs: Vec<&Resource<TaskTable>> = tables.iter().collect();
        let device: DeviceOp = &|gpu, tables| gpu_ops::concat(gpu, tables);
        self.table_op("concat", &inputs, Some(device), |tables| {
            let batches: Vec<&RecordBatch> = tables.iter().map(Table::batch).collect();
            ops::concat(&batches).map_err(op_error)
        })
    }

    fn from_ipc(&mut self, bytes: Vec<u8>) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        self.copies.out_of_guest_bytes += bytes.len() as u64;
        let result = decode_ipc(&bytes).map_err(|e| {
            error(
                ErrorCode::InvalidArgument,
                format!("from-ipc: not a valid Arrow IPC stream: {e}"),
            )
        });
        self.table_result(result)
    }

    fn schema(&mut self, self_: Resource<TaskTable>) -> wasmtime::Result<Vec<Field>> {
        Ok(self
            .table
            .get(&self_)?
            .schema()
            .fields()
            .iter()
            .map(|f| Field {
                name: f.name().clone(),
                data_type: wit_type(f.data_type()),
                nullable: f.is_nullable(),
            })
            .collect())
    }

    fn num_rows(&mut self, self_: Resource<TaskTable>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&self_)?.num_rows() as u64)
    }

    fn column(
        &mut self,
        self_: Resource<TaskTable>,
        name: String,
    ) -> wasmtime::Result<Result<Resource<Column>, Error>> {
        // Column handles are host arrays: a table only on the device gives just this column.
        let table = self.table.get(&self_)?;
        let array = match table {
            TaskTable::Device(resident) => resident.column_on_host(&name),
            TaskTable::Host(table) => Ok(table.batch().column_by_name(&name).cloned()),
        };
        match array {
            Ok(Some(array)) => Ok(Ok(self.table.push(Column::new(name, array))?)),
            Ok(None) => Ok(Err(error(
                ErrorCode::UnknownColumn,
                format!(
                    "unknown column `{name}` (the table has: {})",
                    crate::expr::column_list(&table.schema())
                ),
            ))),
            Err(e) => Ok(Err(error(
                ErrorCode::Internal,
                format!("column `{name}`: copying it from the device failed: {e}"),
            ))),
        }
    }

    fn select(
        &mut self,
        self_: Resource<TaskTable>,
        columns: Vec<String>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let device: DeviceOp = &|_, t| gpu_ops::select(t[0], &columns);
        self.table_op("select", &[&self_], Some(device), |t| {
            ops::select(t[0].batch(), &columns).map_err(op_error)
        })
    }

    fn filter(
        &mut self,
        self_: Resource<TaskTable>,
        predicate: Resource<ExprHandle>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let predicate = self.expr(&predicate)?;
        let device: DeviceOp = &|gpu, t| gpu_ops::filter(gpu, t[0], &predicate);
        let covered =
            self.device_covers(&[&self_], |s| gpu_ops::expression_covers(&s[0], &predicate))?;
        self.table_op("filter", &[&self_], covered.then_some(device), |t| {
            ops::filter(t[0].batch(), &predicate).map_err(op_error)
        })
    }

    fn with_columns(
        &mut self,
        self_: Resource<TaskTable>,
        names: Vec<String>,
        values: Vec<Resource<ExprHandle>>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        if names.len() != values.len() {
            return Ok(Err(error(
                ErrorCode::InvalidArgument,
                format!(
                    "with-columns: {} names for {} expressions",
                    names.len(),
                    values.len()
                ),
            )));
        }
        let exprs = values
            .iter()
            .map(|v| self.expr(v))
            .collect::<wasmtime::Result<Vec<_>>>()?;
        let pairs: Vec<(String, &Expr)> = names
            .into_iter()
            .zip(exprs.iter().map(|e| e.as_ref()))
            .collect();
        let device: DeviceOp = &|gpu, t| gpu_ops::with_columns(gpu, t[0], &pairs);
        let covered = self.device_covers(&[&self_], |s| {
            pairs
                .iter()
                .all(|(_, e)| gpu_ops::expression_covers(&s[0], e))
        })?;
        self.table_op("with-columns", &[&self_], covered.then_some(device), |t| {
            ops::with_columns(t[0].batch(), &pairs).map_err(op_error)
        })
    }

    fn evaluate(
        &mut self,
        self_: Resource<TaskTable>,
        value: Resource<ExprHandle>,
    ) -> wasmtime::Result<Result<Resource<Column>, Error>> {
        let expr = self.expr(&value)?;
        let device: DeviceOp<_> = &|gpu, t| gpu_ops::evaluate(gpu, t[0], &expr);
        let covered =
            self.device_covers(&[&self_], |s| gpu_ops::expression_covers(&s[0], &expr))?;
        let device = covered.then_some(device);
        let placed = self.run_on_device_or_host("evaluate", &[&self_], device, |t| {
            eval::evaluate(&expr, t[0].batch()).map_err(expr_error)
        })?;
        let name = expr.to_string();
        // Column handles are host arrays: the device's result is downloaded.
        let array = match placed {
            Ok(Placed::Device(gpu, column)) => download_array(&gpu, &name, &column).map_err(|e| {
                error(
                    ErrorCode::Internal,
                    format!("evaluate: copying `{name}` from the device failed: {e}"),
                )
            }),
            Ok(Placed::Host(array)) => Ok(array),
            Err(e) => Err(e),
        };
        match array {
            Ok(array) => self.push_column(name, array),
            Err(e) => Ok(Err(e)),
        }
    }

    fn group_by(
        &mut self,
        self_: Resource<TaskTable>,
        keys: Vec<String>,
        aggregates: Vec<Aggregate>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let aggregates = host_aggregates(aggregates);
        let device: DeviceOp = &|gpu, t| gpu_ops::group_by(gpu, t[0], &keys, &aggregates);
        let covered = self.device_covers(&[&self_], |s| {
            gpu_ops::group_by_covers(&s[0], &keys, &aggregates)
        })?;
        self.table_op("group-by", &[&self_], covered.then_some(device), |t| {
            ops::group_by(t[0].batch(), &keys, &aggregates).map_err(op_error)
        })
    }

    fn aggregate(
        &mut self,
        self_: Resource<TaskTable>,
        aggregates: Vec<Aggregate>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let aggregates = host_aggregates(aggregates);
        let device: DeviceOp = &|gpu, t| gpu_ops::aggregate(gpu, t[0], &aggregates);
        let covered =
            self.device_covers(&[&self_], |s| gpu_ops::aggregate_covers(&s[0], &aggregates))?;
        self.table_op("aggregate", &[&self_], covered.then_some(device), |t| {
            ops::aggregate(t[0].batch(), &aggregates).map_err(op_error)
        })
    }

    fn slice(
        &mut self,
        self_: Resource<TaskTable>,
        offset: u64,
        length: u64,
    ) -> wasmtime::Result<Resource<TaskTable>> {
        let device: DeviceOp = &|gpu, t| gpu_ops::slice(gpu, t[0], offset, length);
        let sliced = self.table_op("slice", &[&self_], Some(device), |t| {
            Ok(ops::slice(t[0].batch(), offset, length))
        })?;
        // A slice cannot fail on the host; a failed copy from the device is the host's error.
        sliced.map_err(|e| wasmtime::Error::msg(e.message))
    }

    fn head(
        &mut self,
        self_: Resource<TaskTable>,
        n: u64,
    ) -> wasmtime::Result<Resource<TaskTable>> {
        self.slice(self_, 0, n)
    }

    fn join(
        &mut self,
        self_: Resource<TaskTable>,
        right: Resource<TaskTable>,
        left_on: Vec<String>,
        right_on: Vec<String>,
        how: JoinType,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let how = match how {
            JoinType::Inner => join::JoinType::Inner,
            JoinType::Left => join::JoinType::Left,
            JoinType::Semi => join::JoinType::Semi,
            JoinType::Anti => join::JoinType::Anti,
        };
        // A table every task of the worker shares is built on once: its index is cached.
        let right_shared = self.table.get(&right)?.is_shared();
        let device: DeviceOp =
            &|gpu, t| gpu_ops::join(gpu, t[0], t[1], &left_on, &right_on, how, right_shared);
        let covered = self.device_covers(&[&self_, &right], |s| {
            gpu_ops::join_covers(&s[0], &s[1], &left_on, &right_on)
        })?;
        let cache = self.memory.store().clone();
        self.table_op("join", &[&self_, &right], covered.then_some(device), |t| {
            let (left, right) = (&t[0], &t[1]);
            let cache = cache.build_cache();
            let build = if right.is_shared() {
                join::Build::Shared {
                    side: join::Side::Right,
                    cache,
                }
            } else if left.is_shared() {
                join::Build::Shared {
                    side: join::Side::Left,
                    cache,
                }
            } else {
                join::Build::Smaller
            };
            join::join_with(left.batch(), right.batch(), &left_on, &right_on, how, build)
                .map_err(op_error)
        })
    }

    fn sort(
        &mut self,
        self_: Resource<TaskTable>,
        keys: Vec<SortKey>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let keys = sort_keys(keys);
        let device: DeviceOp = &|gpu, t| gpu_ops::sort(gpu, t[0], &keys);
        let covered = self.device_covers(&[&self_], |s| gpu_ops::sort_covers(&s[0], &keys))?;
        self.table_op("sort", &[&self_], covered.then_some(device), |t| {
            sort::sort(t[0].batch(), &keys).map_err(op_error)
        })
    }

    fn top_k(
        &mut self,
        self_: Resource<TaskTable>,
        keys: Vec<SortKey>,
        k: u64,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let keys = sort_keys(keys);
        let device: DeviceOp = &|gpu, t| gpu_ops::top_k(gpu, t[0], &keys, k);
        let covered = self.device_covers(&[&self_], |s| gpu_ops::sort_covers(&s[0], &keys))?;
        self.table_op("top-k", &[&self_], covered.then_some(device), |t| {
            sort::top_k(t[0].batch(), &keys, k).map_err(op_error)
        })
    }

    fn distinct(
        &mut self,
        self_: Resource<TaskTable>,
        columns: Option<Vec<String>>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let device: DeviceOp = &|gpu, t| gpu_ops::distinct(gpu, t[0], columns.as_deref());
        let covered = self.device_covers(&[&self_], |s| {
            gpu_ops::distinct_covers(&s[0], columns.as_deref())
        })?;
        self.table_op("distinct", &[&self_], covered.then_some(device), |t| {
            ops::distinct(t[0].batch(), columns.as_deref()).map_err(op_error)
        })
    }

    fn hash_partition(
        &mut self,
        self_: Resource<TaskTable>,
        keys: Vec<String>,
        partitions: u32,
    ) -> wasmtime::Result<Result<Vec<Resource<TaskTable>>, Error>> {
        let device: DeviceOp<_> = &|gpu, t| gpu_ops::hash_partition(gpu, t[0], &keys, partitions);
        let placed =
            self.run_on_device_or_host("hash-partition", &[&self_], Some(device), |t| {
                partition::hash_partition(t[0].batch(), &keys, partitions).map_err(op_error)
            })?;
        let mut handles = Vec::new();
        match placed {
            Ok(Placed::Device(gpu, parts)) => {
                for part in parts {
                    handles.push(self.push_device(&gpu, part)?);
                }
            }
            Ok(Placed::Host(parts)) => {
                for part in parts {
                    match self.push_table(part)? {
                        Ok(handle) => handles.push(handle),
                        Err(e) => return Ok(Err(e)),
                    }
                }
            }
            Err(e) => return Ok(Err(e)),
        }
        Ok(Ok(handles))
    }

    fn to_ipc(&mut self, self_: Resource<TaskTable>) -> wasmtime::Result<Result<Vec<u8>, Error>> {
        let table = match self.host_input(&self_, "to-ipc")? {
            Ok(table) => table,
            Err(e) => return Ok(Err(e)),
        };
        // The guest sees value types: dictionary-encoded columns are written out.
        match dictionary::plain_batch(table.batch()).and_then(|batch| encode_ipc(&batch)) {
            Ok(bytes) => {
                self.copies.into_guest_bytes += bytes.len() as u64;
                Ok(Ok(bytes))
            }
            Err(e) => Ok(Err(error(ErrorCode::Internal, format!("to-ipc: {e}")))),
        }
    }

    fn drop(&mut self, rep: Resource<TaskTable>) -> wasmtime::Result<()> {
        self.table.delete(rep)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_values_round_trip_with_nulls() {
        let values = ColumnValues {
            values: Values::Float64(vec![1.5, 0.0, -2.0]),
            validity: Some(vec![true, false, true]),
        };
        let array = from_values("x", values).unwrap();
        assert_eq!(array.null_count(), 1);
        let back = to_values(&array).unwrap();
        assert_eq!(back.validity, Some(vec![true, false, true]));
        match back.values {
            Values::Float64(v) => assert_eq!((v[0], v[2]), (1.5, -2.0)),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn validity_length_mismatch_names_the_column() {
        let values = ColumnValues {
            values: Values::Int64(vec![1, 2]),
            validity: Some(vec![true]),
        };
        let err = from_values("ids", values).unwrap_err();
        assert!(
            err.message
                .contains("column `ids`: 1 validity entries for 2 values"),
            "{}",
            err.message
        );
    }

    #[test]
    fn ipc_round_trip() {
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(vec![ArrowField::new(
                "s",
                ArrowType::Utf8,
                false,
            )])),
            vec![Arc::new(StringArray::from(vec!["a", "bc"]))],
        )
        .unwrap();
        let decoded = decode_ipc(&encode_ipc(&batch).unwrap()).unwrap();
        assert_eq!(decoded, batch);
    }
}
