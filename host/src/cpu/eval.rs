//! Evaluates an [`Expr`] over a `RecordBatch` with Arrow's vectorised compute kernels.
//!
//! The expression is type-checked against the batch's schema first, so every error a guest can
//! cause is reported before any work runs. Literals stay scalars (Arrow `Datum`s) until an
//! operator needs them as arrays.

use std::borrow::Cow;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float64Array, Int64Array, Scalar, StringArray,
    UInt32Array, UInt64Array, new_null_array,
};
use arrow::compute::kernels::{boolean, cmp, numeric, zip};
use arrow::compute::{self, binary, unary};
use arrow::datatypes::{DataType, Float64Type};
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;

use super::compare;
use crate::expr::{Expr, ExprError, Literal, common_type, numeric_result};
use crate::guest_api::wit::{BinaryOp, UnaryOp};

/// An intermediate value: a full column, or one value standing for every row.
#[derive(Debug, Clone)]
enum Value {
    Array(ArrayRef),
    Scalar(ArrayRef),
}

impl Value {
    fn array(&self) -> &ArrayRef {
        match self {
            Value::Array(a) | Value::Scalar(a) => a,
        }
    }

    fn datum(&self) -> Box<dyn arrow::array::Datum + '_> {
        match self {
            Value::Array(a) => Box::new(a.clone()),
            Value::Scalar(a) => Box::new(Scalar::new(a.clone())),
        }
    }

    fn map(
        self,
        f: impl FnOnce(&ArrayRef) -> Result<ArrayRef, ArrowError>,
    ) -> Result<Self, ArrowError> {
        Ok(match self {
            Value::Array(a) => Value::Array(f(&a)?),
            Value::Scalar(a) => Value::Scalar(f(&a)?),
        })
    }

    fn cast(self, to: &DataType) -> Result<Self, ArrowError> {
        if self.array().data_type() == to {
            return Ok(self);
        }
        self.map(|a| compute::cast(a, to))
    }

    fn is_scalar(&self) -> bool {
        matches!(self, Value::Scalar(_))
    }

    /// Repeats a scalar to `rows` rows.
    fn into_array(self, rows: usize) -> Result<ArrayRef, ArrowError> {
        match self {
            Value::Array(a) => Ok(a),
            Value::Scalar(a) => {
                let indices = UInt32Array::from(vec![0u32; rows]);
                compute::take(&a, &indices, None)
            }
        }
    }
}

/// Evaluates `expr` to a column as long as `batch`: in one fused pass where the expression is
/// numeric or boolean ([`super::fused`]), with one Arrow kernel per node otherwise.
pub fn evaluate(expr: &Expr, batch: &RecordBatch) -> Result<ArrayRef, ExprError> {
    let batch = decoded_for(expr, batch)?;
    match super::fused::try_evaluate(expr, &batch) {
        Some(result) => result,
        None => kernels(expr, &batch),
    }
}

/// `batch` with the dictionary-encoded columns that `expr` reads decoded: expressions compute
/// on values (borrowed when there are none).
fn decoded_for<'a>(expr: &Expr, batch: &'a RecordBatch) -> Result<Cow<'a, RecordBatch>, ExprError> {
    let read = expr.columns();
    super::dictionary::plain_columns(batch, |name| read.iter().any(|c| c == name)).map_err(|e| {
        ExprError::Evaluation {
            expr: expr.to_string(),
            detail: e.to_string(),
        }
    })
}

/// Evaluates `expr` with one Arrow kernel per node (the reference the fused path is tested
/// against, and the path for strings, dates and casts the fused program does not cover).
pub fn evaluate_with_kernels(expr: &Expr, batch: &RecordBatch) -> Result<ArrayRef, ExprError> {
    kernels(expr, &*decoded_for(expr, batch)?)
}

/// [`evaluate_with_kernels`] over a batch whose columns `expr` reads are decoded already.
fn kernels(expr: &Expr, batch: &RecordBatch) -> Result<ArrayRef, ExprError> {
    expr.data_type(&batch.schema())?;
    let value = eval(expr, batch).map_err(|e| ExprError::Evaluation {
        expr: expr.to_string(),
        detail: e.to_string(),
    })?;
    value
        .into_array(batch.num_rows())
        .map_err(|e| ExprError::Evaluation {
            expr: expr.to_string(),
            detail: e.to_string(),
        })
}

/// Evaluates a boolean `predicate`; null counts as false.
pub fn evaluate_predicate(
    predicate: &Expr,
    batch: &RecordBatch,
) -> Result<BooleanArray, ExprError> {
    let data_type = predicate.data_type(&batch.schema())?;
    if !matches!(data_type, DataType::Boolean | DataType::Null) {
        return Err(ExprError::TypeMismatch {
            expr: predicate.to_string(),
            detail: format!("a filter predicate must be boolean, found {data_type}"),
        });
    }
    let array = evaluate(predicate, batch)?;
    let array = compute::cast(&array, &DataType::Boolean).map_err(|e| ExprError::Evaluation {
        expr: predicate.to_string(),
        detail: e.to_string(),
    })?;
    Ok(array.as_boolean().clone())
}

fn eval(expr: &Expr, batch: &RecordBatch) -> Result<Value, ArrowError> {
    let schema = batch.schema();
    let type_of = |e: &Expr| {
        e.data_type(&schema)
            .map_err(|err| ArrowError::InvalidArgumentError(err.to_string()))
    };
    match expr {
        Expr::Column(name) => {
            let index = schema.index_of(name)?;
            Ok(Value::Array(batch.column(index).clone()))
        }
        Expr::Literal(literal) => Ok(Value::Scalar(literal_array(literal))),
        Expr::Binary { op, lhs, rhs } => {
            let (left_type, right_type) = (type_of(lhs)?, type_of(rhs)?);
            let left = eval(lhs, batch)?;
            let right = eval(rhs, batch)?;
            eval_binary(*op, left, right, &left_type, &right_type)
        }
        Expr::Unary { op, arg } => {
            let arg_type = type_of(arg)?;
            eval_unary(*op, eval(arg, batch)?, &arg_type)
        }
        Expr::Cast { arg, to } => eval(arg, batch)?.cast(to),
        Expr::FillNull { arg, fill } => {
            let target = type_of(expr)?;
            let value = eval(arg, batch)?.cast(&target)?;
            let fill = eval(fill, batch)?.cast(&target)?;
            let mask = value
                .clone()
                .map(|a| Ok(Arc::new(boolean::is_not_null(a)?) as ArrayRef))?;
            select(mask, value, fill)
        }
        Expr::IfElse {
            condition,
            then,
            otherwise,
        } => {
            let target = type_of(expr)?;
            let condition = eval(condition, batch)?.cast(&DataType::Boolean)?;
            let then = eval(then, batch)?.cast(&target)?;
            let otherwise = eval(otherwise, batch)?.cast(&target)?;
            let chosen = select(condition.clone(), then, otherwise)?;
            // A null condition gives null, not the `otherwise` branch.
            if condition.array().null_count() == 0 {
                return Ok(chosen);
            }
            let rows = chosen.array().len().max(condition.array().len());
            let scalar = chosen.is_scalar() && condition.is_scalar();
            let unknown = boolean::is_null(condition.into_array(rows)?.as_ref())?;
            let result = arrow::compute::nullif(chosen.into_array(rows)?.as_ref(), &unknown)?;
            Ok(wrap(scalar, result))
        }
    }
}

/// Row-wise `mask ? truthy : falsy`; a null mask entry selects `falsy`.
fn select(mask: Value, truthy: Value, falsy: Value) -> Result<Value, ArrowError> {
    let all_scalar = mask.is_scalar() && truthy.is_scalar() && falsy.is_scalar();
    let mask_array = mask.array().as_boolean().clone();
    let rows = [
        mask.array().len(),
        truthy.array().len(),
        falsy.array().len(),
    ]
    .into_iter()
    .max()
    .unwrap_or(1);
    let mask_array = if mask.is_scalar() && rows > 1 {
        Value::Scalar(Arc::new(mask_array))
            .into_array(rows)?
            .as_boolean()
            .clone()
    } else {
        mask_array
    };
    let result = zip::zip(&mask_array, &*truthy.datum(), &*falsy.datum())?;
    Ok(if all_scalar {
        Value::Scalar(result)
    } else {
        Value::Array(result)
    })
}

fn literal_array(literal: &Literal) -> ArrayRef {
    match literal {
        Literal::Null => new_null_array(&DataType::Null, 1),
        Literal::Boolean(v) => Arc::new(BooleanArray::from(vec![*v])),
        Literal::Int64(v) => Arc::new(Int64Array::from(vec![*v])),
        Literal::UInt64(v) => Arc::new(UInt64Array::from(vec![*v])),
        Literal::Float64(v) => Arc::new(Float64Array::from(vec![*v])),
        Literal::Utf8(v) => Arc::new(StringArray::from(vec![v.as_str()])),
    }
}

fn both_scalar(left: &Value, right: &Value) -> bool {
    left.is_scalar() && right.is_scalar()
}

fn wrap(scalar: bool, array: ArrayRef) -> Value {
    if scalar {
        Value::Scalar(array)
    } else {
        Value::Array(array)
    }
}

fn eval_binary(
    op: BinaryOp,
    left: Value,
    right: Value,
    left_type: &DataType,
    right_type: &DataType,
) -> Result<Value, ArrowError> {
    use BinaryOp::*;
    let scalar = both_scalar(&left, &right);
    let invalid =
        || ArrowError::InvalidArgumentError(format!("{op:?} on {left_type} and {right_type}"));
    match op {
        Add | Sub | Mul | Rem => {
            let target = numeric_result(left_type, right_type).ok_or_else(invalid)?;
            let (l, r) = (left.cast(&target)?, right.cast(&target)?);
            let (l, r) = (l.datum(), r.datum());
            let result = match op {
                Add => numeric::add_wrapping(&*l, &*r)?,
                Sub => numeric::sub_wrapping(&*l, &*r)?,
                Mul => numeric::mul_wrapping(&*l, &*r)?,
                _ => numeric::rem(&*l, &*r)?,
            };
            Ok(wrap(scalar, result))
        }
        Div => {
            let (l, r) = (
                left.cast(&DataType::Float64)?,
                right.cast(&DataType::Float64)?,
            );
            Ok(wrap(scalar, numeric::div(&*l.datum(), &*r.datum())?))
        }
        Pow | Atan2 => {
            let rows = left.array().len().max(right.array().len());
            let l = left.cast(&DataType::Float64)?.into_array(rows)?;
            let r = right.cast(&DataType::Float64)?.into_array(rows)?;
            let (l, r) = (
                l.as_primitive::<Float64Type>(),
                r.as_primitive::<Float64Type>(),
            );
            let result: Float64Array = match op {
                Pow => binary(l, r, f64::powf)?,
                _ => binary(l, r, f64::atan2)?,
            };
            Ok(wrap(scalar, Arc::new(result)))
        }
        Eq | Ne | Lt | Le | Gt | Ge => {
            let target = common_type(left_type, right_type).ok_or_else(invalid)?;
            let (l, r) = (left.cast(&target)?, right.cast(&target)?);
            let with_scalar = match (&l, &r) {
                (Value::Array(column), Value::Scalar(value)) => {
                    compare::compare_with_scalar(op, column.as_ref(), value.as_ref(), false)
                }
                (Value::Scalar(value), Value::Array(column)) => {
                    compare::compare_with_scalar(op, column.as_ref(), value.as_ref(), true)
                }
                _ => None,
            };
            if let Some(mask) = with_scalar {
                return Ok(Value::Array(Arc::new(mask)));
            }
            let (l, r) = (l.datum(), r.datum());
            let result = match op {
                Eq => cmp::eq(&*l, &*r)?,
                Ne => cmp::neq(&*l, &*r)?,
                Lt => cmp::lt(&*l, &*r)?,
                Le => cmp::lt_eq(&*l, &*r)?,
                Gt => cmp::gt(&*l, &*r)?,
                _ => cmp::gt_eq(&*l, &*r)?,
            };
            Ok(wrap(scalar, Arc::new(result)))
        }
        And | Or => {
            let rows = left.array().len().max(right.array().len());
            let l = left.cast(&DataType::Boolean)?.into_array(rows)?;
            let r = right.cast(&DataType::Boolean)?.into_array(rows)?;
            let result = match op {
                And => boolean::and_kleene(l.as_boolean(), r.as_boolean())?,
                _ => boolean::or_kleene(l.as_boolean(), r.as_boolean())?,
            };
            Ok(wrap(scalar, Arc::new(result)))
        }
    }
}

/// The `f64` function of a math operator (`sqrt` ... `round`), shared by both evaluation paths.
pub(super) fn math_fn(op: UnaryOp) -> Option<fn(f64) -> f64> {
    use UnaryOp::*;
    Some(match op {
        Sqrt => f64::sqrt,
        Exp => f64::exp,
        Log => f64::ln,
        Sin => f64::sin,
        Cos => f64::cos,
        Tan => f64::tan,
        Asin => f64::asin,
        Acos => f64::acos,
        Atan => f64::atan,
        Floor => f64::floor,
        Ceil => f64::ceil,
        Round => f64::round,
        Neg | Not | Abs | IsNull | IsNotNull => return None,
    })
}

fn eval_unary(op: UnaryOp, arg: Value, arg_type: &DataType) -> Result<Value, ArrowError> {
    use UnaryOp::*;
    match op {
        IsNull => arg.map(|a| Ok(Arc::new(boolean::is_null(a)?) as ArrayRef)),
        IsNotNull => arg.map(|a| Ok(Arc::new(boolean::is_not_null(a)?) as ArrayRef)),
        Not => arg
            .cast(&DataType::Boolean)?
            .map(|a| Ok(Arc::new(boolean::not(a.as_boolean())?) as ArrayRef)),
        Neg => {
            let target = numeric_result(arg_type, arg_type).unwrap_or(DataType::Float64);
            arg.cast(&target)?.map(|a| numeric::neg_wrapping(a))
        }
        Abs => {
            let target = numeric_result(arg_type, arg_type).unwrap_or(DataType::Float64);
            let arg = arg.cast(&target)?;
            arg.map(|a| {
                let negated = numeric::neg_wrapping(a)?;
                let negative = cmp::lt(
                    a,
                    &Scalar::new(compute::cast(&Int64Array::from(vec![0]), &target)?),
                )?;
                zip::zip(&negative, &negated, a)
            })
        }
        _ => {
            let f = math_fn(op).ok_or_else(|| {
                ArrowError::InvalidArgumentError(format!("{op:?} is not a math function"))
            })?;
            arg.cast(&DataType::Float64)?.map(|a| {
                let a = a.as_primitive::<Float64Type>();
                let mut values = vec![0.0; a.len()];
                let result = if super::vector_math::apply(op, a.values(), &mut values) {
                    Float64Array::new(values.into(), a.nulls().cloned())
                } else {
                    unary(a, f)
                };
                Ok(Arc::new(result) as ArrayRef)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{Field, Schema};

    fn batch() -> RecordBatch {
        let schema = Schema::new(vec![
            Field::new("x", DataType::Float64, true),
            Field::new("n", DataType::Int32, true),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(Float64Array::from(vec![Some(1.0), None, Some(-4.0)])),
                Arc::new(arrow::array::Int32Array::from(vec![Some(2), Some(3), None])),
            ],
        )
        .unwrap()
    }

    fn arc(e: Expr) -> Arc<Expr> {
        Arc::new(e)
    }

    fn lit(v: f64) -> Expr {
        Expr::Literal(Literal::Float64(v))
    }

    #[test]
    fn arithmetic_with_literals_and_nulls() {
        let e = Expr::Binary {
            op: BinaryOp::Add,
            lhs: arc(Expr::Binary {
                op: BinaryOp::Mul,
                lhs: arc(Expr::col("x")),
                rhs: arc(Expr::col("n")),
            }),
            rhs: arc(lit(0.5)),
        };
        let out = evaluate(&e, &batch()).unwrap();
        let out = out.as_primitive::<Float64Type>();
        assert_eq!(out.value(0), 2.5);
        assert!(out.is_null(1));
        assert!(out.is_null(2));
    }

    #[test]
    fn math_functions_and_abs() {
        let e = Expr::Unary {
            op: UnaryOp::Sqrt,
            arg: arc(Expr::Unary {
                op: UnaryOp::Abs,
                arg: arc(Expr::col("x")),
            }),
        };
        let out = evaluate(&e, &batch()).unwrap();
        let out = out.as_primitive::<Float64Type>();
        assert_eq!(out.value(0), 1.0);
        assert_eq!(out.value(2), 2.0);
    }

    #[test]
    fn fill_null_and_if_else() {
        let filled = Expr::FillNull {
            arg: arc(Expr::col("x")),
            fill: arc(lit(9.0)),
        };
        let out = evaluate(&filled, &batch()).unwrap();
        assert_eq!(
            out.as_primitive::<Float64Type>().values(),
            &[1.0, 9.0, -4.0]
        );

        let e = Expr::IfElse {
            condition: arc(Expr::Binary {
                op: BinaryOp::Gt,
                lhs: arc(filled),
                rhs: arc(lit(0.0)),
            }),
            then: arc(Expr::Literal(Literal::Utf8("pos".into()))),
            otherwise: arc(Expr::Literal(Literal::Utf8("neg".into()))),
        };
        let out = evaluate(&e, &batch()).unwrap();
        let out = out.as_string::<i32>();
        assert_eq!(
            (out.value(0), out.value(1), out.value(2)),
            ("pos", "pos", "neg")
        );
    }

    #[test]
    fn scalar_only_expression_is_broadcast_to_the_batch_length() {
        let e = Expr::Binary {
            op: BinaryOp::Pow,
            lhs: arc(lit(2.0)),
            rhs: arc(lit(10.0)),
        };
        let out = evaluate(&e, &batch()).unwrap();
        assert_eq!(out.as_primitive::<Float64Type>().values(), &[1024.0; 3]);
    }

    #[test]
    fn predicate_must_be_boolean() {
        let err = evaluate_predicate(&Expr::col("x"), &batch()).unwrap_err();
        assert!(err.to_string().contains("must be boolean"), "{err}");
    }
}
