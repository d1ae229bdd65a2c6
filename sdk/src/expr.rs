//! Scalar expressions over the columns of a table: [`col`], [`lit`], operators and methods.
//!
//! An [`Expr`] is a handle to an expression held by the host. Building one does no work: the
//! host checks it against a table's schema and evaluates it in one fused pass when a table
//! operator ([`Table::filter`](crate::Table::filter),
//! [`Table::with_column`](crate::Table::with_column), ...) uses it.
//!
//! Rust numbers and booleans convert into literal expressions, so `col("x") * 2.0`,
//! `col("x").gt(0)` and `1.0 - col("p")` all work. Strings do not convert implicitly (a string
//! could equally mean a column name): write [`lit("text")`](lit) or [`col("name")`](col).
//! Integer literals are `int64` (`uint64` for unsigned Rust types), float literals `float64`.

use std::fmt;
use std::ops::{Add, Div, Mul, Neg, Not, Rem, Sub};
use std::rc::Rc;

use crate::bindings::wrk::task::dataframe::{BinaryOp, Expr as RawExpr, UnaryOp};
use crate::types::{DataType, Scalar};

/// A cheap-to-clone handle to a scalar expression held by the host.
#[derive(Clone)]
pub struct Expr(Rc<RawExpr>);

/// The column named `name`.
pub fn col(name: &str) -> Expr {
    Expr::from_raw(RawExpr::col(name))
}

/// A literal value; `lit(None::<f64>)` is null.
pub fn lit(value: impl Into<Scalar>) -> Expr {
    Expr::from_raw(RawExpr::lit(&value.into()))
}

/// `then` where `condition` is true, otherwise `otherwise`; null conditions give null.
pub fn if_else(
    condition: impl Into<Expr>,
    then: impl Into<Expr>,
    otherwise: impl Into<Expr>,
) -> Expr {
    let (condition, then, otherwise) = (condition.into(), then.into(), otherwise.into());
    Expr::from_raw(RawExpr::if_else(
        condition.as_raw(),
        then.as_raw(),
        otherwise.as_raw(),
    ))
}

/// Starts a conditional: `when(cond).then(a).otherwise(b)` is [`if_else(cond, a, b)`](if_else).
pub fn when(condition: impl Into<Expr>) -> When {
    When {
        condition: condition.into(),
    }
}

/// A conditional waiting for its `then` value; see [`when`].
#[must_use = "a conditional needs `.then(..).otherwise(..)`"]
pub struct When {
    condition: Expr,
}

impl When {
    /// The value where the condition is true.
    pub fn then(self, value: impl Into<Expr>) -> Then {
        Then {
            condition: self.condition,
            then: value.into(),
        }
    }
}

/// A conditional waiting for its `otherwise` value; see [`when`].
#[must_use = "a conditional needs `.otherwise(..)`"]
pub struct Then {
    condition: Expr,
    then: Expr,
}

impl Then {
    /// The value where the condition is false; completes the conditional.
    pub fn otherwise(self, value: impl Into<Expr>) -> Expr {
        if_else(self.condition, self.then, value)
    }
}

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(&self, rhs: impl Into<Expr>) -> Expr {
            self.binary(BinaryOp::$op, rhs.into())
        }
    )*};
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(&self) -> Expr {
            self.unary(UnaryOp::$op)
        }
    )*};
}

impl Expr {
    /// Wraps a raw expression handle.
    pub fn from_raw(raw: RawExpr) -> Self {
        Self(Rc::new(raw))
    }

    /// The raw expression handle.
    pub fn as_raw(&self) -> &RawExpr {
        &self.0
    }

    fn binary(&self, op: BinaryOp, rhs: Expr) -> Expr {
        Expr::from_raw(RawExpr::binary(op, self.as_raw(), rhs.as_raw()))
    }

    fn unary(&self, op: UnaryOp) -> Expr {
        Expr::from_raw(RawExpr::unary(op, self.as_raw()))
    }

    binary_methods! {
        /// `self == rhs`.
        eq => Eq;
        /// `self != rhs`.
        ne => Ne;
        /// `self < rhs`.
        lt => Lt;
        /// `self <= rhs`.
        le => Le;
        /// `self > rhs`.
        gt => Gt;
        /// `self >= rhs`.
        ge => Ge;
        /// Logical and of two boolean expressions.
        and => And;
        /// Logical or of two boolean expressions.
        or => Or;
        /// `self` raised to the power `rhs`.
        pow => Pow;
        /// The four-quadrant arctangent of `self / rhs` (`self` is y, `rhs` is x), in radians.
        atan2 => Atan2;
    }

    unary_methods! {
        /// Absolute value.
        abs => Abs;
        /// Square root.
        sqrt => Sqrt;
        /// `e` raised to the power `self`.
        exp => Exp;
        /// Natural logarithm.
        ln => Log;
        /// Sine (radians).
        sin => Sin;
        /// Cosine (radians).
        cos => Cos;
        /// Tangent (radians).
        tan => Tan;
        /// Arcsine, in radians.
        asin => Asin;
        /// Arccosine, in radians.
        acos => Acos;
        /// Arctangent, in radians.
        atan => Atan;
        /// Largest integer value not above `self`.
        floor => Floor;
        /// Smallest integer value not below `self`.
        ceil => Ceil;
        /// Nearest integer value.
        round => Round;
        /// True where `self` is null.
        is_null => IsNull;
        /// True where `self` is not null.
        is_not_null => IsNotNull;
    }

    /// `self` converted to `to`.
    pub fn cast(&self, to: DataType) -> Expr {
        Expr::from_raw(RawExpr::cast(self.as_raw(), to))
    }

    /// `self` where it is not null, otherwise `fill`.
    pub fn fill_null(&self, fill: impl Into<Expr>) -> Expr {
        let fill = fill.into();
        Expr::from_raw(RawExpr::fill_null(self.as_raw(), fill.as_raw()))
    }
}

/// Renders the expression as the host does in error messages.
impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_raw().to_string())
    }
}

impl fmt::Debug for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Expr")
            .field(&self.as_raw().to_string())
            .finish()
    }
}

impl From<&Expr> for Expr {
    fn from(expr: &Expr) -> Self {
        expr.clone()
    }
}

impl From<Scalar> for Expr {
    fn from(value: Scalar) -> Self {
        lit(value)
    }
}

macro_rules! literal_conversions {
    ($($t:ty),*) => {$(
        impl From<$t> for Expr {
            fn from(value: $t) -> Self {
                lit(value)
            }
        }
    )*};
}

literal_conversions!(bool, i8, i16, i32, i64, u8, u16, u32, u64, f32, f64);

macro_rules! arithmetic {
    ($($trait:ident $method:ident => $op:ident;)*) => {$(
        impl<T: Into<Expr>> $trait<T> for Expr {
            type Output = Expr;
            fn $method(self, rhs: T) -> Expr {
                self.binary(BinaryOp::$op, rhs.into())
            }
        }

        impl<T: Into<Expr>> $trait<T> for &Expr {
            type Output = Expr;
            fn $method(self, rhs: T) -> Expr {
                self.binary(BinaryOp::$op, rhs.into())
            }
        }

        arithmetic!(@numbers $trait $method => $op; i32 i64 u32 u64 f32 f64);
    )*};
    (@numbers $trait:ident $method:ident => $op:ident; $($n:ty)*) => {$(
        impl $trait<Expr> for $n {
            type Output = Expr;
            fn $method(self, rhs: Expr) -> Expr {
                lit(self).binary(BinaryOp::$op, rhs)
            }
        }

        impl $trait<&Expr> for $n {
            type Output = Expr;
            fn $method(self, rhs: &Expr) -> Expr {
                lit(self).binary(BinaryOp::$op, rhs.clone())
            }
        }
    )*};
}

arithmetic! {
    Add add => Add;
    Sub sub => Sub;
    Mul mul => Mul;
    Div div => Div;
    Rem rem => Rem;
}

impl Neg for Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        self.unary(UnaryOp::Neg)
    }
}

impl Neg for &Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        self.unary(UnaryOp::Neg)
    }
}

/// Logical negation of a boolean expression.
impl Not for Expr {
    type Output = Expr;
    fn not(self) -> Expr {
        self.unary(UnaryOp::Not)
    }
}

/// Logical negation of a boolean expression.
impl Not for &Expr {
    type Output = Expr;
    fn not(self) -> Expr {
        self.unary(UnaryOp::Not)
    }
}
