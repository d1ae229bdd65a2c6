//! Scalar expressions over a table's columns: the tree a guest builds through `expr` handles,
//! its type checking against a schema, and its rendering for error messages.
//!
//! Type checking happens before any data is touched, so a wrong column name or a type mismatch is
//! reported with the expression and the column named. Evaluation lives with each backend
//! (`cpu::eval` for Arrow).

use std::fmt;
use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};

use crate::guest_api::wit::{BinaryOp, UnaryOp};

mod memo;
pub(crate) use memo::TreeMemo;

/// A literal value.
#[derive(Debug, Clone, PartialEq)]
pub enum Literal {
    Null,
    Boolean(bool),
    Int64(i64),
    UInt64(u64),
    Float64(f64),
    Utf8(String),
}

impl Literal {
    pub fn data_type(&self) -> DataType {
        match self {
            Literal::Null => DataType::Null,
            Literal::Boolean(_) => DataType::Boolean,
            Literal::Int64(_) => DataType::Int64,
            Literal::UInt64(_) => DataType::UInt64,
            Literal::Float64(_) => DataType::Float64,
            Literal::Utf8(_) => DataType::Utf8,
        }
    }
}

/// An expression node. Children are shared (`Arc`) because guests build trees bottom-up from
/// handles they may reuse.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    Column(String),
    Literal(Literal),
    Binary {
        op: BinaryOp,
        lhs: Arc<Expr>,
        rhs: Arc<Expr>,
    },
    Unary {
        op: UnaryOp,
        arg: Arc<Expr>,
    },
    Cast {
        arg: Arc<Expr>,
        to: DataType,
    },
    FillNull {
        arg: Arc<Expr>,
        fill: Arc<Expr>,
    },
    IfElse {
        condition: Arc<Expr>,
        then: Arc<Expr>,
        otherwise: Arc<Expr>,
    },
}

/// Why an expression cannot be evaluated against a schema or a batch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExprError {
    #[error("unknown column `{column}` in expression `{expr}` (the table has: {available})")]
    UnknownColumn {
        column: String,
        expr: String,
        available: String,
    },
    #[error("type mismatch in expression `{expr}`: {detail}")]
    TypeMismatch { expr: String, detail: String },
    #[error("evaluating expression `{expr}` failed: {detail}")]
    Evaluation { expr: String, detail: String },
}

impl Expr {
    pub fn col(name: impl Into<String>) -> Self {
        Expr::Column(name.into())
    }

    /// Whether `other` is the same expression, with float literals equal only to the bit (so
    /// `x / -0.0` is not `x / 0.0`, which `==` says it is): what a cache of compiled
    /// expressions must compare.
    pub fn identical(&self, other: &Expr) -> bool {
        let same = |a: &Arc<Expr>, b: &Arc<Expr>| Arc::ptr_eq(a, b) || a.identical(b);
        match (self, other) {
            (Expr::Column(a), Expr::Column(b)) => a == b,
            (Expr::Literal(Literal::Float64(a)), Expr::Literal(Literal::Float64(b))) => {
                a.to_bits() == b.to_bits()
            }
            (Expr::Literal(a), Expr::Literal(b)) => a == b,
            (
                Expr::Binary { op, lhs, rhs },
                Expr::Binary {
                    op: op2,
                    lhs: lhs2,
                    rhs: rhs2,
                },
            ) => op == op2 && same(lhs, lhs2) && same(rhs, rhs2),
            (Expr::Unary { op, arg }, Expr::Unary { op: op2, arg: arg2 }) => {
                op == op2 && same(arg, arg2)
            }
            (Expr::Cast { arg, to }, Expr::Cast { arg: arg2, to: to2 }) => {
                to == to2 && same(arg, arg2)
            }
            (
                Expr::FillNull { arg, fill },
                Expr::FillNull {
                    arg: arg2,
                    fill: fill2,
                },
            ) => same(arg, arg2) && same(fill, fill2),
            (
                Expr::IfElse {
                    condition,
                    then,
                    otherwise,
                },
                Expr::IfElse {
                    condition: condition2,
                    then: then2,
                    otherwise: otherwise2,
                },
            ) => same(condition, condition2) && same(then, then2) && same(otherwise, otherwise2),
            _ => false,
        }
    }

    /// The names of the columns the expression reads, each once, in order of first use.
    pub fn columns(&self) -> Vec<String> {
        fn walk(expr: &Expr, out: &mut Vec<String>) {
            match expr {
                Expr::Column(name) => {
                    if !out.contains(name) {
                        out.push(name.clone());
                    }
                }
                Expr::Literal(_) => {}
                Expr::Binary { lhs, rhs, .. } => {
                    walk(lhs, out);
                    walk(rhs, out);
                }
                Expr::Unary { arg, .. } | Expr::Cast { arg, .. } => walk(arg, out),
                Expr::FillNull { arg, fill } => {
                    walk(arg, out);
                    walk(fill, out);
                }
                Expr::IfElse {
                    condition,
                    then,
                    otherwise,
                } => {
                    walk(condition, out);
                    walk(then, out);
                    walk(otherwise, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(self, &mut out);
        out
    }

    /// The type of the values this expression yields on a table of `schema`. Errors name this
    /// whole expression (and, for type errors, the part at fault).
    pub fn data_type(&self, schema: &Schema) -> Result<DataType, ExprError> {
        self.infer(schema).map_err(|e| {
            let whole = self.to_string();
            match e {
                ExprError::UnknownColumn {
                    column, available, ..
                } => ExprError::UnknownColumn {
                    column,
                    expr: whole,
                    available,
                },
                ExprError::TypeMismatch { expr, detail } if expr != whole => {
                    ExprError::TypeMismatch {
                        expr: whole,
                        detail: format!("in `{expr}`: {detail}"),
                    }
                }
                other => other,
            }
        })
    }

    fn infer(&self, schema: &Schema) -> Result<DataType, ExprError> {
        match self {
            Expr::Column(name) => schema
                .field_with_name(name)
                .map(|field| crate::cpu::dictionary::logical_type(field.data_type()).clone())
                .map_err(|_| ExprError::UnknownColumn {
                    column: name.clone(),
                    expr: self.to_string(),
                    available: column_list(schema),
                }),
            Expr::Literal(literal) => Ok(literal.data_type()),
            Expr::Binary { op, lhs, rhs } => {
                let left = lhs.infer(schema)?;
                let right = rhs.infer(schema)?;
                self.binary_type(*op, &left, &right)
            }
            Expr::Unary { op, arg } => {
                let input = arg.infer(schema)?;
                self.unary_type(*op, &input)
            }
            Expr::Cast { arg, to } => {
                let from = arg.infer(schema)?;
                if arrow::compute::can_cast_types(&from, to) {
                    Ok(to.clone())
                } else {
                    Err(self.mismatch(format!("cannot cast {from} to {to}")))
                }
            }
            Expr::FillNull { arg, fill } => {
                let value = arg.infer(schema)?;
                let fill = fill.infer(schema)?;
                common_type(&value, &fill).ok_or_else(|| {
                    self.mismatch(format!("cannot fill nulls of {value} with {fill}"))
                })
            }
            Expr::IfElse {
                condition,
                then,
                otherwise,
            } => {
                let condition_type = condition.infer(schema)?;
                if !matches!(condition_type, DataType::Boolean | DataType::Null) {
                    return Err(self.mismatch(format!(
                        "the condition must be boolean, found {condition_type}"
                    )));
                }
                let then = then.infer(schema)?;
                let otherwise = otherwise.infer(schema)?;
                common_type(&then, &otherwise).ok_or_else(|| {
                    self.mismatch(format!(
                        "branches have incompatible types {then} and {otherwise}"
                    ))
                })
            }
        }
    }

    fn binary_type(
        &self,
        op: BinaryOp,
        left: &DataType,
        right: &DataType,
    ) -> Result<DataType, ExprError> {
        use BinaryOp::*;
        match op {
            Add | Sub | Mul | Rem => numeric_result(left, right).ok_or_else(|| {
                self.mismatch(format!("{op:?} needs numbers, found {left} and {right}"))
            }),
            Div | Pow | Atan2 => {
                if is_numeric_or_null(left) && is_numeric_or_null(right) {
                    Ok(DataType::Float64)
                } else {
                    Err(self.mismatch(format!("{op:?} needs numbers, found {left} and {right}")))
                }
            }
            Eq | Ne | Lt | Le | Gt | Ge => {
                if common_type(left, right).is_some() {
                    Ok(DataType::Boolean)
                } else {
                    Err(self.mismatch(format!("cannot compare {left} with {right}")))
                }
            }
            And | Or => {
                if is_boolean_or_null(left) && is_boolean_or_null(right) {
                    Ok(DataType::Boolean)
                } else {
                    Err(self.mismatch(format!("{op:?} needs booleans, found {left} and {right}")))
                }
            }
        }
    }

    fn unary_type(&self, op: UnaryOp, input: &DataType) -> Result<DataType, ExprError> {
        use UnaryOp::*;
        match op {
            IsNull | IsNotNull => Ok(DataType::Boolean),
            Not => {
                if is_boolean_or_null(input) {
                    Ok(DataType::Boolean)
                } else {
                    Err(self.mismatch(format!("not needs a boolean, found {input}")))
                }
            }
            Neg | Abs => numeric_result(input, input)
                .ok_or_else(|| self.mismatch(format!("{op:?} needs a number, found {input}"))),
            Sqrt | Exp | Log | Sin | Cos | Tan | Asin | Acos | Atan | Floor | Ceil | Round => {
                if is_numeric_or_null(input) {
                    Ok(DataType::Float64)
                } else {
                    Err(self.mismatch(format!("{op:?} needs a number, found {input}")))
                }
            }
        }
    }

    fn mismatch(&self, detail: String) -> ExprError {
        ExprError::TypeMismatch {
            expr: self.to_string(),
            detail,
        }
    }
}

/// The columns of a schema, for error messages.
pub fn column_list(schema: &Schema) -> String {
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    names.join(", ")
}

pub fn is_numeric_or_null(data_type: &DataType) -> bool {
    data_type.is_numeric() || *data_type == DataType::Null
}

fn is_boolean_or_null(data_type: &DataType) -> bool {
    matches!(data_type, DataType::Boolean | DataType::Null)
}

/// The type both operands of an arithmetic operator are brought to: any float makes `Float64`,
/// integers widen to 64 bits (`UInt64` only when both are unsigned).
pub fn numeric_result(left: &DataType, right: &DataType) -> Option<DataType> {
    if !is_numeric_or_null(left) || !is_numeric_or_null(right) {
        return None;
    }
    let float = |t: &DataType| t.is_floating();
    let unsigned = |t: &DataType| t.is_unsigned_integer() || *t == DataType::Null;
    Some(if float(left) || float(right) {
        DataType::Float64
    } else if unsigned(left) && unsigned(right) {
        if *left == DataType::Null && *right == DataType::Null {
            DataType::Int64
        } else {
            DataType::UInt64
        }
    } else {
        DataType::Int64
    })
}

/// The type two values are compared or merged as, if they are compatible at all.
pub fn common_type(left: &DataType, right: &DataType) -> Option<DataType> {
    if left == right {
        return Some(left.clone());
    }
    match (left, right) {
        (DataType::Null, other) | (other, DataType::Null) => Some(other.clone()),
        _ if left.is_numeric() && right.is_numeric() => numeric_result(left, right),
        (DataType::Utf8 | DataType::LargeUtf8, DataType::Utf8 | DataType::LargeUtf8) => {
            Some(DataType::Utf8)
        }
        _ => None,
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Column(name) => write!(f, "col({name:?})"),
            Expr::Literal(literal) => match literal {
                Literal::Null => write!(f, "null"),
                Literal::Boolean(v) => write!(f, "{v}"),
                Literal::Int64(v) => write!(f, "{v}"),
                Literal::UInt64(v) => write!(f, "{v}u"),
                Literal::Float64(v) => write!(f, "{v:?}"),
                Literal::Utf8(v) => write!(f, "{v:?}"),
            },
            Expr::Binary { op, lhs, rhs } => {
                let symbol = match op {
                    BinaryOp::Add => "+",
                    BinaryOp::Sub => "-",
                    BinaryOp::Mul => "*",
                    BinaryOp::Div => "/",
                    BinaryOp::Rem => "%",
                    BinaryOp::Eq => "==",
                    BinaryOp::Ne => "!=",
                    BinaryOp::Lt => "<",
                    BinaryOp::Le => "<=",
                    BinaryOp::Gt => ">",
                    BinaryOp::Ge => ">=",
                    BinaryOp::And => "and",
                    BinaryOp::Or => "or",
                    BinaryOp::Pow => return write!(f, "pow({lhs}, {rhs})"),
                    BinaryOp::Atan2 => return write!(f, "atan2({lhs}, {rhs})"),
                };
                write!(f, "({lhs} {symbol} {rhs})")
            }
            Expr::Unary { op, arg } => {
                let name = format!("{op:?}").to_lowercase();
                write!(f, "{name}({arg})")
            }
            Expr::Cast { arg, to } => write!(f, "cast({arg} as {to})"),
            Expr::FillNull { arg, fill } => write!(f, "fill_null({arg}, {fill})"),
            Expr::IfElse {
                condition,
                then,
                otherwise,
            } => write!(f, "if_else({condition}, {then}, {otherwise})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::Field;

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("fare", DataType::Float64, true),
            Field::new("passengers", DataType::Int32, true),
            Field::new("vendor", DataType::Utf8, true),
        ])
    }

    fn bin(op: BinaryOp, lhs: Expr, rhs: Expr) -> Expr {
        Expr::Binary {
            op,
            lhs: Arc::new(lhs),
            rhs: Arc::new(rhs),
        }
    }

    #[test]
    fn identical_expressions_match_float_literals_to_the_bit() {
        let over = |v: f64| {
            bin(
                BinaryOp::Div,
                Expr::col("fare"),
                Expr::Literal(Literal::Float64(v)),
            )
        };
        assert!(over(2.0).identical(&over(2.0)));
        assert!(over(f64::NAN).identical(&over(f64::NAN)));
        assert_eq!(over(0.0), over(-0.0));
        assert!(!over(0.0).identical(&over(-0.0)));
        assert!(!over(2.0).identical(&over(3.0)));
        let other_column = bin(
            BinaryOp::Div,
            Expr::col("passengers"),
            Expr::Literal(Literal::Float64(2.0)),
        );
        assert!(!over(2.0).identical(&other_column));
        let other_op = bin(
            BinaryOp::Mul,
            Expr::col("fare"),
            Expr::Literal(Literal::Float64(2.0)),
        );
        assert!(!over(2.0).identical(&other_op));
        let cast = |to| Expr::Cast {
            arg: Arc::new(Expr::col("fare")),
            to,
        };
        assert!(cast(DataType::Int64).identical(&cast(DataType::Int64)));
        assert!(!cast(DataType::Int64).identical(&cast(DataType::UInt64)));
    }

    #[test]
    fn arithmetic_promotes_to_float_when_any_side_is_float() {
        let e = bin(BinaryOp::Mul, Expr::col("fare"), Expr::col("passengers"));
        assert_eq!(e.data_type(&schema()), Ok(DataType::Float64));
        let e = bin(
            BinaryOp::Add,
            Expr::col("passengers"),
            Expr::Literal(Literal::Int64(1)),
        );
        assert_eq!(e.data_type(&schema()), Ok(DataType::Int64));
    }

    #[test]
    fn unknown_column_names_the_column_the_expression_and_the_schema() {
        let e = bin(
            BinaryOp::Gt,
            Expr::col("fair"),
            Expr::Literal(Literal::Float64(0.0)),
        );
        let err = e.data_type(&schema()).unwrap_err().to_string();
        assert!(err.contains("`fair`"), "{err}");
        assert!(err.contains("(col(\"fair\") > 0.0)"), "{err}");
        assert!(err.contains("fare, passengers, vendor"), "{err}");
    }

    #[test]
    fn math_on_strings_is_a_type_mismatch() {
        let e = Expr::Unary {
            op: UnaryOp::Sqrt,
            arg: Arc::new(Expr::col("vendor")),
        };
        let err = e.data_type(&schema()).unwrap_err();
        assert!(matches!(err, ExprError::TypeMismatch { .. }), "{err}");
        assert!(err.to_string().contains("sqrt(col(\"vendor\"))"), "{err}");
    }
}
