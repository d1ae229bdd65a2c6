//! Fused expression evaluation: an expression is compiled into a small register program and run
//! over blocks of rows, so every intermediate value lives in a cache-sized buffer and no
//! full-length column is built per operator.
//!
//! The program covers numbers and booleans (arithmetic, math functions, comparisons, boolean
//! logic, null tests, fill-null, if-else, numeric casts). A part it does not cover (a string
//! comparison, a date cast) is evaluated once by the Arrow kernels of [`super::eval`] and read
//! by the program like a column; an expression whose result is not a number or a boolean is left
//! to those kernels entirely. Semantics match the kernel path exactly (wrapping integer
//! arithmetic, floats compared by total order, null propagation, Kleene logic); the tests check
//! the two paths against each other.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Float64Array, Int64Array, UInt64Array};
use arrow::buffer::NullBuffer;
use arrow::compute;
use arrow::datatypes::{
    ArrowPrimitiveType, DataType, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type,
    Int64Type, Schema, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow::record_batch::RecordBatch;

use crate::expr::{Expr, ExprError, Literal, TreeMemo, common_type, numeric_result};
use crate::guest_api::wit::{BinaryOp, UnaryOp};
use crate::memory::buffers::{self, PooledVec};

/// Rows per block: small enough that a program's registers stay in the L1/L2 cache.
const BLOCK: usize = 1024;

/// The value kinds a register holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    F64,
    I64,
    U64,
    Bool,
}

impl Kind {
    /// The register kind of an Arrow type, if the program can hold it.
    fn of(data_type: &DataType) -> Option<Kind> {
        use DataType::*;
        Some(match data_type {
            Float16 | Float32 | Float64 => Kind::F64,
            Int8 | Int16 | Int32 | Int64 => Kind::I64,
            UInt8 | UInt16 | UInt32 | UInt64 => Kind::U64,
            Boolean | Null => Kind::Bool,
            _ => return None,
        })
    }

    fn data_type(self) -> DataType {
        match self {
            Kind::F64 => DataType::Float64,
            Kind::I64 => DataType::Int64,
            Kind::U64 => DataType::UInt64,
            Kind::Bool => DataType::Boolean,
        }
    }
}

/// One block of values of a register.
#[derive(Debug, Clone)]
enum Values {
    F64(Vec<f64>),
    I64(Vec<i64>),
    U64(Vec<u64>),
    Bool(Vec<bool>),
}

impl Values {
    fn kind(&self) -> Kind {
        match self {
            Values::F64(_) => Kind::F64,
            Values::I64(_) => Kind::I64,
            Values::U64(_) => Kind::U64,
            Values::Bool(_) => Kind::Bool,
        }
    }

    fn new(kind: Kind) -> Self {
        match kind {
            Kind::F64 => Values::F64(vec![0.0; BLOCK]),
            Kind::I64 => Values::I64(vec![0; BLOCK]),
            Kind::U64 => Values::U64(vec![0; BLOCK]),
            Kind::Bool => Values::Bool(vec![false; BLOCK]),
        }
    }
}

/// A block-sized buffer: values, and validity when some value may be null.
#[derive(Debug, Clone)]
struct Register {
    values: Values,
    valid: Vec<bool>,
    /// False when every value of the current block is valid (then `valid` is not read).
    nullable: bool,
}

impl Register {
    fn new(kind: Kind) -> Self {
        Register {
            values: Values::new(kind),
            valid: vec![true; BLOCK],
            nullable: false,
        }
    }

    fn is_valid(&self, i: usize) -> bool {
        !self.nullable || self.valid[i]
    }
}

type Reg = usize;

/// One step of a program; every step writes its own register.
#[derive(Debug, Clone)]
enum Step {
    /// Reads a block of input `input` (a column, or a part evaluated by the kernels).
    Load {
        input: usize,
        dst: Reg,
    },
    /// Converts `src` to the kind of `dst`.
    Convert {
        src: Reg,
        dst: Reg,
    },
    Arith {
        op: BinaryOp,
        a: Reg,
        b: Reg,
        dst: Reg,
    },
    Compare {
        op: BinaryOp,
        a: Reg,
        b: Reg,
        dst: Reg,
    },
    Logic {
        op: BinaryOp,
        a: Reg,
        b: Reg,
        dst: Reg,
    },
    Unary {
        op: UnaryOp,
        src: Reg,
        dst: Reg,
    },
    FillNull {
        src: Reg,
        fill: Reg,
        dst: Reg,
    },
    IfElse {
        cond: Reg,
        then: Reg,
        otherwise: Reg,
        dst: Reg,
    },
}

/// A compiled expression.
struct Program {
    inputs: Vec<ArrayRef>,
    /// Constants are written at compile time; every other register by exactly one step.
    registers: Vec<Register>,
    steps: Vec<Step>,
    result: Reg,
    result_type: DataType,
}

/// Evaluates `expr` over `batch` in fused blocks, or returns `None` when the expression has no
/// numeric or boolean part worth fusing (the caller then uses the kernel path).
pub fn try_evaluate(expr: &Expr, batch: &RecordBatch) -> Option<Result<ArrayRef, ExprError>> {
    let schema = batch.schema();
    let result_type = match expr.data_type(&schema) {
        Ok(t) => t,
        Err(e) => return Some(Err(e)),
    };
    if matches!(expr, Expr::Column(_) | Expr::Literal(_))
        || column_against_literal(expr, &schema)
        || !fusible(expr, &schema)
    {
        return None;
    }
    let mut compiler = Compiler {
        batch,
        schema: &schema,
        memo: TreeMemo::new(&schema),
        seen: HashMap::new(),
        program: Program {
            inputs: Vec::new(),
            registers: Vec::new(),
            steps: Vec::new(),
            result: 0,
            result_type,
        },
    };
    Some(
        compiler
            .compile(expr)
            .and_then(|result| {
                compiler.program.result = result;
                compiler.program.run(batch.num_rows())
            })
            .map_err(|detail| ExprError::Evaluation {
                expr: expr.to_string(),
                detail,
            }),
    )
}

/// Whether `expr` compares a column with a literal of the column's own type (`fare > 30.0`, the
/// usual filter): Arrow's comparison kernel reads the column in place and writes the bits
/// directly, where the program would copy each block into a register first.
fn column_against_literal(expr: &Expr, schema: &Schema) -> bool {
    let Expr::Binary { op, lhs, rhs } = expr else {
        return false;
    };
    let comparison = matches!(
        op,
        BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge
    );
    let same_type = |a: &Expr, b: &Expr| {
        matches!((a, b), (Expr::Column(_), Expr::Literal(_)))
            && matches!((a.data_type(schema), b.data_type(schema)), (Ok(x), Ok(y)) if x == y)
    };
    comparison && (same_type(lhs, rhs) || same_type(rhs, lhs))
}

/// Whether the program can evaluate `expr`'s top node itself (its children may still be leaves
/// the kernels evaluate). The GPU code generator fuses exactly the nodes this admits.
pub(crate) fn fusible(expr: &Expr, schema: &Schema) -> bool {
    fusible_typed(expr, |e| e.data_type(schema).ok())
}

/// [`fusible`] with the types of `expr` and its operands from `type_of` (a compiler's memo).
pub(crate) fn fusible_typed<'t>(
    expr: &'t Expr,
    mut type_of: impl FnMut(&'t Expr) -> Option<DataType>,
) -> bool {
    let mut kind_of = |e: &'t Expr| type_of(e).as_ref().and_then(Kind::of);
    let Some(kind) = kind_of(expr) else {
        return false;
    };
    match expr {
        Expr::Column(_) => true,
        Expr::Literal(literal) => !matches!(literal, Literal::Utf8(_)),
        Expr::Binary { op, lhs, rhs } => {
            let (Some(l), Some(r)) = (kind_of(lhs), kind_of(rhs)) else {
                return false;
            };
            match op {
                BinaryOp::And | BinaryOp::Or => true,
                BinaryOp::Eq
                | BinaryOp::Ne
                | BinaryOp::Lt
                | BinaryOp::Le
                | BinaryOp::Gt
                | BinaryOp::Ge => (l == Kind::Bool) == (r == Kind::Bool),
                _ => l != Kind::Bool || r != Kind::Bool,
            }
        }
        Expr::Unary { op, arg } => {
            let input_type = type_of(arg);
            let Some(input) = input_type.as_ref().and_then(Kind::of) else {
                return false;
            };
            match op {
                UnaryOp::Neg | UnaryOp::Abs => kind != Kind::U64,
                UnaryOp::Not | UnaryOp::IsNull | UnaryOp::IsNotNull => true,
                _ => input != Kind::Bool || input_type == Some(DataType::Null),
            }
        }
        // Casts the program does exactly as the kernels do; any other cast is theirs.
        Expr::Cast { arg, to } => {
            let Some(from) = type_of(arg) else {
                return false;
            };
            let boolean_or_null = matches!(from, DataType::Boolean | DataType::Null);
            match to {
                DataType::Float64 => from.is_numeric() || boolean_or_null,
                DataType::Int64 => from.is_integer() || boolean_or_null,
                DataType::UInt64 => from.is_unsigned_integer() || boolean_or_null,
                _ => false,
            }
        }
        Expr::FillNull { arg, fill } => kind_of(arg).is_some() && kind_of(fill).is_some(),
        Expr::IfElse {
            condition,
            then,
            otherwise,
        } => {
            kind_of(condition).is_some() && kind_of(then).is_some() && kind_of(otherwise).is_some()
        }
    }
}

struct Compiler<'a> {
    batch: &'a RecordBatch,
    schema: &'a Schema,
    program: Program,
    /// The expression's node numbers and types.
    memo: TreeMemo<'a>,
    /// The register of every subexpression compiled so far, by its node number.
    seen: HashMap<usize, Reg>,
}

impl<'a> Compiler<'a> {
    fn register(&mut self, kind: Kind) -> Reg {
        self.program.registers.push(Register::new(kind));
        self.program.registers.len() - 1
    }

    fn kind(&self, reg: Reg) -> Kind {
        self.program.registers[reg].values.kind()
    }

    fn type_of(&mut self, expr: &'a Expr) -> Result<DataType, String> {
        self.memo.data_type(expr).map_err(|e| e.to_string())
    }

    /// A register holding `reg` converted to `kind`.
    fn convert(&mut self, reg: Reg, kind: Kind) -> Reg {
        if self.kind(reg) == kind {
            return reg;
        }
        let dst = self.register(kind);
        self.program.steps.push(Step::Convert { src: reg, dst });
        dst
    }

    /// A leaf: an input array read block by block.
    fn load(&mut self, array: ArrayRef) -> Result<Reg, String> {
        let kind = Kind::of(array.data_type())
            .ok_or_else(|| format!("cannot fuse a column of type {}", array.data_type()))?;
        self.program.inputs.push(array);
        let dst = self.register(kind);
        self.program.steps.push(Step::Load {
            input: self.program.inputs.len() - 1,
            dst,
        });
        Ok(dst)
    }

    fn constant(&mut self, literal: &Literal) -> Result<Reg, String> {
        let (kind, values) = match literal {
            Literal::Null => (Kind::Bool, Values::Bool(vec![false; BLOCK])),
            Literal::Boolean(v) => (Kind::Bool, Values::Bool(vec![*v; BLOCK])),
            Literal::Int64(v) => (Kind::I64, Values::I64(vec![*v; BLOCK])),
            Literal::UInt64(v) => (Kind::U64, Values::U64(vec![*v; BLOCK])),
            Literal::Float64(v) => (Kind::F64, Values::F64(vec![*v; BLOCK])),
            Literal::Utf8(_) => return Err("string literals are not fused".into()),
        };
        let null = matches!(literal, Literal::Null);
        let reg = self.register(kind);
        self.program.registers[reg] = Register {
            values,
            valid: vec![!null; BLOCK],
            nullable: null,
        };
        Ok(reg)
    }

    /// Compiles `expr` once: a subexpression that occurs again (the same handle reused by the
    /// guest, or an equal tree built twice) reads the register of its first occurrence.
    fn compile(&mut self, expr: &'a Expr) -> Result<Reg, String> {
        let key = self.memo.id(expr);
        if let Some(&reg) = self.seen.get(&key) {
            return Ok(reg);
        }
        let reg = self.compile_node(expr)?;
        self.seen.insert(key, reg);
        Ok(reg)
    }

    fn compile_node(&mut self, expr: &'a Expr) -> Result<Reg, String> {
        if !fusible_typed(expr, |e| self.memo.data_type(e).ok()) {
            let array =
                super::eval::evaluate_with_kernels(expr, self.batch).map_err(|e| e.to_string())?;
            return self.load(array);
        }
        match expr {
            Expr::Column(name) => {
                let index = self.schema.index_of(name).map_err(|e| e.to_string())?;
                self.load(self.batch.column(index).clone())
            }
            Expr::Literal(literal) => self.constant(literal),
            Expr::Binary { op, lhs, rhs } => {
                let (left_type, right_type) = (self.type_of(lhs)?, self.type_of(rhs)?);
                let (a, b) = (self.compile(lhs)?, self.compile(rhs)?);
                use BinaryOp::*;
                let operand = match op {
                    Add | Sub | Mul | Rem => kind_of_type(numeric_result(&left_type, &right_type))?,
                    Div | Pow | Atan2 => Kind::F64,
                    Eq | Ne | Lt | Le | Gt | Ge => {
                        kind_of_type(common_type(&left_type, &right_type))?
                    }
                    And | Or => Kind::Bool,
                };
                let (a, b) = (self.convert(a, operand), self.convert(b, operand));
                let op = *op;
                let comparison = matches!(op, Eq | Ne | Lt | Le | Gt | Ge);
                let logic = matches!(op, And | Or);
                let dst = self.register(if comparison || logic {
                    Kind::Bool
                } else {
                    operand
                });
                let step = if comparison {
                    Step::Compare { op, a, b, dst }
                } else if logic {
                    Step::Logic { op, a, b, dst }
                } else {
                    Step::Arith { op, a, b, dst }
                };
                self.program.steps.push(step);
                Ok(dst)
            }
            Expr::Unary { op, arg } => {
                let input_type = self.type_of(arg)?;
                let src = self.compile(arg)?;
                use UnaryOp::*;
                let (operand, result) = match op {
                    IsNull | IsNotNull => (self.kind(src), Kind::Bool),
                    Not => (Kind::Bool, Kind::Bool),
                    Neg | Abs => {
                        let kind = kind_of_type(numeric_result(&input_type, &input_type))?;
                        (kind, kind)
                    }
                    _ => (Kind::F64, Kind::F64),
                };
                let src = self.convert(src, operand);
                let dst = self.register(result);
                self.program.steps.push(Step::Unary { op: *op, src, dst });
                Ok(dst)
            }
            Expr::Cast { arg, to } => {
                let kind = kind_of_type(Some(to.clone()))?;
                let src = self.compile(arg)?;
                Ok(self.convert(src, kind))
            }
            Expr::FillNull { arg, fill } => {
                let kind = kind_of_type(Some(self.type_of(expr)?))?;
                let (src, fill) = (self.compile(arg)?, self.compile(fill)?);
                let (src, fill) = (self.convert(src, kind), self.convert(fill, kind));
                let dst = self.register(kind);
                self.program.steps.push(Step::FillNull { src, fill, dst });
                Ok(dst)
            }
            Expr::IfElse {
                condition,
                then,
                otherwise,
            } => {
                let kind = kind_of_type(Some(self.type_of(expr)?))?;
                let cond = self.compile(condition)?;
                let cond = self.convert(cond, Kind::Bool);
                let (then, otherwise) = (self.compile(then)?, self.compile(otherwise)?);
                let (then, otherwise) = (self.convert(then, kind), self.convert(otherwise, kind));
                let dst = self.register(kind);
                self.program.steps.push(Step::IfElse {
                    cond,
                    then,
                    otherwise,
                    dst,
                });
                Ok(dst)
            }
        }
    }
}

fn kind_of_type(data_type: Option<DataType>) -> Result<Kind, String> {
    data_type
        .as_ref()
        .and_then(Kind::of)
        .ok_or_else(|| format!("no register kind for {data_type:?}"))
}

impl Program {
    /// Runs the program over every block and assembles the result column.
    fn run(mut self, rows: usize) -> Result<ArrayRef, String> {
        let kind = self.registers[self.result].values.kind();
        let mut out = Output::new(kind, rows);
        let steps = std::mem::take(&mut self.steps);
        let mut start = 0;
        while start < rows {
            let len = BLOCK.min(rows - start);
            for step in &steps {
                self.execute(step, start, len)?;
            }
            out.append(&self.registers[self.result], len);
            start += len;
        }
        let array = out.finish();
        if *array.data_type() == self.result_type {
            Ok(array)
        } else {
            compute::cast(&array, &self.result_type).map_err(|e| e.to_string())
        }
    }

    fn execute(&mut self, step: &Step, start: usize, len: usize) -> Result<(), String> {
        let dst = match step {
            Step::Load { dst, .. }
            | Step::Convert { dst, .. }
            | Step::Arith { dst, .. }
            | Step::Compare { dst, .. }
            | Step::Logic { dst, .. }
            | Step::Unary { dst, .. }
            | Step::FillNull { dst, .. }
            | Step::IfElse { dst, .. } => *dst,
        };
        // Every step reads registers written before it, so the destination can be taken out.
        let mut out = std::mem::replace(
            &mut self.registers[dst],
            Register {
                values: Values::Bool(Vec::new()),
                valid: Vec::new(),
                nullable: false,
            },
        );
        let regs = &self.registers;
        let result = match step {
            Step::Load { input, .. } => {
                load(&self.inputs[*input], start, len, &mut out);
                Ok(())
            }
            Step::Convert { src, .. } => {
                convert(&regs[*src], len, &mut out);
                Ok(())
            }
            Step::Arith { op, a, b, .. } => arith(*op, &regs[*a], &regs[*b], len, &mut out),
            Step::Compare { op, a, b, .. } => {
                compare(*op, &regs[*a], &regs[*b], len, &mut out);
                Ok(())
            }
            Step::Logic { op, a, b, .. } => {
                logic(*op, &regs[*a], &regs[*b], len, &mut out);
                Ok(())
            }
            Step::Unary { op, src, .. } => {
                unary(*op, &regs[*src], len, &mut out);
                Ok(())
            }
            Step::FillNull { src, fill, .. } => {
                fill_null(&regs[*src], &regs[*fill], len, &mut out);
                Ok(())
            }
            Step::IfElse {
                cond,
                then,
                otherwise,
                ..
            } => {
                if_else(&regs[*cond], &regs[*then], &regs[*otherwise], len, &mut out);
                Ok(())
            }
        };
        self.registers[dst] = out;
        result
    }
}

/// Copies rows `start..start + len` of `array` into `out`, widening to the register's kind.
fn load(array: &ArrayRef, start: usize, len: usize, out: &mut Register) {
    /// Rows `start..start + len` of a primitive `array`, converted by `f` into `dst`.
    fn widen<T: ArrowPrimitiveType, U>(
        array: &ArrayRef,
        start: usize,
        len: usize,
        dst: &mut [U],
        f: impl Fn(T::Native) -> U,
    ) {
        let src = &array.as_primitive::<T>().values()[start..start + len];
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f(s);
        }
    }
    match (&mut out.values, array.data_type()) {
        (Values::F64(dst), DataType::Float64) => dst[..len]
            .copy_from_slice(&array.as_primitive::<Float64Type>().values()[start..start + len]),
        (Values::F64(dst), DataType::Float32) => {
            widen::<Float32Type, _>(array, start, len, dst, f64::from)
        }
        (Values::I64(dst), DataType::Int64) => dst[..len]
            .copy_from_slice(&array.as_primitive::<Int64Type>().values()[start..start + len]),
        (Values::I64(dst), DataType::Int32) => {
            widen::<Int32Type, _>(array, start, len, dst, i64::from)
        }
        (Values::I64(dst), DataType::Int16) => {
            widen::<Int16Type, _>(array, start, len, dst, i64::from)
        }
        (Values::I64(dst), DataType::Int8) => {
            widen::<Int8Type, _>(array, start, len, dst, i64::from)
        }
        (Values::U64(dst), DataType::UInt64) => dst[..len]
            .copy_from_slice(&array.as_primitive::<UInt64Type>().values()[start..start + len]),
        (Values::U64(dst), DataType::UInt32) => {
            widen::<UInt32Type, _>(array, start, len, dst, u64::from)
        }
        (Values::U64(dst), DataType::UInt16) => {
            widen::<UInt16Type, _>(array, start, len, dst, u64::from)
        }
        (Values::U64(dst), DataType::UInt8) => {
            widen::<UInt8Type, _>(array, start, len, dst, u64::from)
        }
        (Values::Bool(dst), DataType::Boolean) => {
            let values = array.as_boolean().values();
            for (i, d) in dst[..len].iter_mut().enumerate() {
                *d = values.value(start + i);
            }
        }
        (Values::Bool(dst), DataType::Null) => dst[..len].fill(false),
        (_, other) => {
            // Half floats and any type `Kind::of` admits without a branch above.
            let cast = compute::cast(
                &array.slice(start, len),
                &Kind::of(other).unwrap_or(Kind::F64).data_type(),
            );
            if let Ok(cast) = cast {
                load(&cast, 0, len, out);
                return;
            }
        }
    }
    match array.logical_nulls() {
        Some(nulls) if array.data_type() == &DataType::Null || nulls.null_count() > 0 => {
            out.nullable = true;
            for (i, v) in out.valid[..len].iter_mut().enumerate() {
                *v = nulls.is_valid(start + i);
            }
        }
        _ => out.nullable = false,
    }
}

/// Sets `out`'s validity to the rows valid in both registers.
fn both_valid(a: &Register, b: &Register, len: usize, out: &mut Register) {
    out.nullable = a.nullable || b.nullable;
    if out.nullable {
        for i in 0..len {
            out.valid[i] = a.is_valid(i) && b.is_valid(i);
        }
    }
}

fn copy_valid(src: &Register, len: usize, out: &mut Register) {
    out.nullable = src.nullable;
    if src.nullable {
        out.valid[..len].copy_from_slice(&src.valid[..len]);
    }
}

fn convert(src: &Register, len: usize, out: &mut Register) {
    copy_valid(src, len, out);
    macro_rules! map {
        ($from:expr, $to:expr, $f:expr) => {
            for (d, s) in $to[..len].iter_mut().zip(&$from[..len]) {
                *d = $f(*s);
            }
        };
    }
    match (&src.values, &mut out.values) {
        (Values::I64(s), Values::F64(d)) => map!(s, d, |v: i64| v as f64),
        (Values::U64(s), Values::F64(d)) => map!(s, d, |v: u64| v as f64),
        (Values::Bool(s), Values::F64(d)) => map!(s, d, |v: bool| f64::from(u8::from(v))),
        (Values::U64(s), Values::I64(d)) => {
            // Arrow's cast makes values beyond i64 null.
            for i in 0..len {
                match i64::try_from(s[i]) {
                    Ok(v) => d[i] = v,
                    Err(_) => {
                        if !out.nullable {
                            out.nullable = true;
                            out.valid[..len].fill(true);
                        }
                        out.valid[i] = false;
                    }
                }
            }
        }
        (Values::Bool(s), Values::I64(d)) => map!(s, d, |v: bool| i64::from(v)),
        (Values::Bool(s), Values::U64(d)) => map!(s, d, |v: bool| u64::from(v)),
        (Values::F64(s), Values::Bool(d)) => map!(s, d, |v: f64| v != 0.0),
        (Values::I64(s), Values::Bool(d)) => map!(s, d, |v: i64| v != 0),
        (Values::U64(s), Values::Bool(d)) => map!(s, d, |v: u64| v != 0),
        (Values::F64(s), Values::F64(d)) => d[..len].copy_from_slice(&s[..len]),
        (Values::I64(s), Values::I64(d)) => d[..len].copy_from_slice(&s[..len]),
        (Values::U64(s), Values::U64(d)) => d[..len].copy_from_slice(&s[..len]),
        (Values::Bool(s), Values::Bool(d)) => d[..len].copy_from_slice(&s[..len]),
        // Narrowing conversions are never planned: `fusible` leaves them to the kernels.
        (Values::F64(_), _) | (Values::I64(_), Values::U64(_)) => {
            out.nullable = true;
            out.valid[..len].fill(false);
        }
    }
}

fn arith(
    op: BinaryOp,
    a: &Register,
    b: &Register,
    len: usize,
    out: &mut Register,
) -> Result<(), String> {
    both_valid(a, b, len, out);
    macro_rules! zip {
        ($x:expr, $y:expr, $d:expr, $f:expr) => {
            for ((d, x), y) in $d[..len].iter_mut().zip(&$x[..len]).zip(&$y[..len]) {
                *d = $f(*x, *y);
            }
        };
    }
    match (&a.values, &b.values, &mut out.values) {
        (Values::F64(x), Values::F64(y), Values::F64(d)) => match op {
            BinaryOp::Add => zip!(x, y, d, |x: f64, y: f64| x + y),
            BinaryOp::Sub => zip!(x, y, d, |x: f64, y: f64| x - y),
            BinaryOp::Mul => zip!(x, y, d, |x: f64, y: f64| x * y),
            BinaryOp::Div => zip!(x, y, d, |x: f64, y: f64| x / y),
            BinaryOp::Rem => zip!(x, y, d, |x: f64, y: f64| x % y),
            BinaryOp::Pow => zip!(x, y, d, f64::powf),
            _ => zip!(x, y, d, f64::atan2),
        },
        (Values::I64(x), Values::I64(y), Values::I64(d)) => match op {
            BinaryOp::Add => zip!(x, y, d, i64::wrapping_add),
            BinaryOp::Sub => zip!(x, y, d, i64::wrapping_sub),
            BinaryOp::Mul => zip!(x, y, d, i64::wrapping_mul),
            _ => {
                check_divisors(y.iter().map(|v| *v == 0), b, len)?;
                zip!(x, y, d, |x: i64, y: i64| if y == 0 {
                    0
                } else {
                    x.wrapping_rem(y)
                })
            }
        },
        (Values::U64(x), Values::U64(y), Values::U64(d)) => match op {
            BinaryOp::Add => zip!(x, y, d, u64::wrapping_add),
            BinaryOp::Sub => zip!(x, y, d, u64::wrapping_sub),
            BinaryOp::Mul => zip!(x, y, d, u64::wrapping_mul),
            _ => {
                check_divisors(y.iter().map(|v| *v == 0), b, len)?;
                zip!(x, y, d, |x: u64, y: u64| if y == 0 { 0 } else { x % y })
            }
        },
        _ => return Err(format!("{op:?} on mismatched registers")),
    }
    Ok(())
}

/// Integer remainder by a (valid) zero is an error, as in the kernels.
fn check_divisors(
    zero: impl Iterator<Item = bool>,
    divisor: &Register,
    len: usize,
) -> Result<(), String> {
    if zero
        .take(len)
        .enumerate()
        .any(|(i, z)| z && divisor.is_valid(i))
    {
        Err("Divide by zero error".into())
    } else {
        Ok(())
    }
}

fn compare(op: BinaryOp, a: &Register, b: &Register, len: usize, out: &mut Register) {
    both_valid(a, b, len, out);
    let Values::Bool(d) = &mut out.values else {
        return;
    };
    fn apply<T>(
        op: BinaryOp,
        x: &[T],
        y: &[T],
        d: &mut [bool],
        cmp: impl Fn(&T, &T) -> std::cmp::Ordering,
    ) {
        use std::cmp::Ordering::*;
        let test: fn(std::cmp::Ordering) -> bool = match op {
            BinaryOp::Eq => |o| o == Equal,
            BinaryOp::Ne => |o| o != Equal,
            BinaryOp::Lt => |o| o == Less,
            BinaryOp::Le => |o| o != Greater,
            BinaryOp::Gt => |o| o == Greater,
            _ => |o| o != Less,
        };
        for ((d, x), y) in d.iter_mut().zip(x).zip(y) {
            *d = test(cmp(x, y));
        }
    }
    match (&a.values, &b.values) {
        (Values::F64(x), Values::F64(y)) => apply(op, &x[..len], &y[..len], d, f64::total_cmp),
        (Values::I64(x), Values::I64(y)) => apply(op, &x[..len], &y[..len], d, Ord::cmp),
        (Values::U64(x), Values::U64(y)) => apply(op, &x[..len], &y[..len], d, Ord::cmp),
        (Values::Bool(x), Values::Bool(y)) => apply(op, &x[..len], &y[..len], d, Ord::cmp),
        _ => {}
    }
}

/// Kleene logic: `false and null` is false, `true or null` is true.
fn logic(op: BinaryOp, a: &Register, b: &Register, len: usize, out: &mut Register) {
    let (Values::Bool(x), Values::Bool(y), Values::Bool(d)) =
        (&a.values, &b.values, &mut out.values)
    else {
        return;
    };
    let and = op == BinaryOp::And;
    for i in 0..len {
        d[i] = if and { x[i] && y[i] } else { x[i] || y[i] };
    }
    out.nullable = a.nullable || b.nullable;
    if out.nullable {
        for i in 0..len {
            let (va, vb) = (a.is_valid(i), b.is_valid(i));
            // The side that decides alone: false for `and`, true for `or`.
            let decides = |valid: bool, value: bool| valid && value != and;
            out.valid[i] = (va && vb) || decides(va, x[i]) || decides(vb, y[i]);
            if out.valid[i] && !(va && vb) {
                d[i] = !and;
            }
        }
    }
}

fn unary(op: UnaryOp, src: &Register, len: usize, out: &mut Register) {
    use UnaryOp::*;
    match op {
        IsNull | IsNotNull => {
            out.nullable = false;
            if let Values::Bool(d) = &mut out.values {
                for (i, d) in d[..len].iter_mut().enumerate() {
                    *d = src.is_valid(i) == (op == IsNotNull);
                }
            }
            return;
        }
        _ => copy_valid(src, len, out),
    }
    match (&src.values, &mut out.values) {
        (Values::Bool(s), Values::Bool(d)) => {
            for i in 0..len {
                d[i] = !s[i];
            }
        }
        (Values::I64(s), Values::I64(d)) => {
            for i in 0..len {
                d[i] = if op == Neg {
                    s[i].wrapping_neg()
                } else {
                    s[i].wrapping_abs()
                };
            }
        }
        (Values::F64(s), Values::F64(d)) => {
            if super::vector_math::apply(op, &s[..len], &mut d[..len]) {
                return;
            }
            let f: fn(f64) -> f64 = match op {
                Neg => |v| -v,
                Abs => f64::abs,
                // The compiler plans only numeric unary steps on float registers.
                _ => super::eval::math_fn(op).unwrap_or(f64::round),
            };
            for i in 0..len {
                d[i] = f(s[i]);
            }
        }
        _ => {}
    }
}

/// Copies row `i` of `src` into `out` (same kind).
fn copy_row(src: &Register, i: usize, out: &mut Register) {
    match (&src.values, &mut out.values) {
        (Values::F64(s), Values::F64(d)) => d[i] = s[i],
        (Values::I64(s), Values::I64(d)) => d[i] = s[i],
        (Values::U64(s), Values::U64(d)) => d[i] = s[i],
        (Values::Bool(s), Values::Bool(d)) => d[i] = s[i],
        _ => {}
    }
}

fn fill_null(src: &Register, fill: &Register, len: usize, out: &mut Register) {
    out.nullable = src.nullable && fill.nullable;
    for i in 0..len {
        let from = if src.is_valid(i) { src } else { fill };
        copy_row(from, i, out);
        out.valid[i] = from.is_valid(i);
    }
}

/// `then` where the condition is true, `otherwise` where it is false, null where it is null.
fn if_else(cond: &Register, then: &Register, otherwise: &Register, len: usize, out: &mut Register) {
    let Values::Bool(c) = &cond.values else {
        return;
    };
    out.nullable = cond.nullable || then.nullable || otherwise.nullable;
    for (i, &chosen) in c[..len].iter().enumerate() {
        let from = if chosen { then } else { otherwise };
        copy_row(from, i, out);
        out.valid[i] = cond.is_valid(i) && from.is_valid(i);
    }
}

/// The result column, grown block by block. Booleans and validity are packed into bits as each
/// block arrives (every block but the last is a multiple of 8 rows long).
struct Output {
    values: OutputValues,
    valid: Option<Vec<u8>>,
    rows: usize,
}

/// Numeric results come from the buffer pool (`memory::buffers`): a repeated operator reuses
/// the blocks of the columns it made before instead of faulting fresh pages in.
enum OutputValues {
    F64(PooledVec<f64>),
    I64(PooledVec<i64>),
    U64(PooledVec<u64>),
    Bits(Vec<u8>),
}

/// Appends `bools` as little-endian bits (Arrow's layout), eight to a byte.
fn pack(bools: &[bool], out: &mut Vec<u8>) {
    let chunks = bools.chunks_exact(8);
    let rest = chunks.remainder();
    out.extend(chunks.map(|c| {
        c.iter()
            .enumerate()
            .fold(0u8, |byte, (bit, &set)| byte | (u8::from(set) << bit))
    }));
    if !rest.is_empty() {
        out.push(
            rest.iter()
                .enumerate()
                .fold(0u8, |byte, (bit, &set)| byte | (u8::from(set) << bit)),
        );
    }
}

fn bits(bytes: Vec<u8>, rows: usize) -> arrow::buffer::BooleanBuffer {
    arrow::buffer::BooleanBuffer::new(arrow::buffer::Buffer::from_vec(bytes), 0, rows)
}

impl Output {
    fn new(kind: Kind, rows: usize) -> Self {
        let values = match kind {
            Kind::F64 => OutputValues::F64(PooledVec::with_capacity(buffers::global(), rows)),
            Kind::I64 => OutputValues::I64(PooledVec::with_capacity(buffers::global(), rows)),
            Kind::U64 => OutputValues::U64(PooledVec::with_capacity(buffers::global(), rows)),
            Kind::Bool => OutputValues::Bits(Vec::with_capacity(rows.div_ceil(8))),
        };
        Output {
            values,
            valid: None,
            rows: 0,
        }
    }

    fn append(&mut self, reg: &Register, len: usize) {
        match (&mut self.values, &reg.values) {
            (OutputValues::F64(d), Values::F64(s)) => d.extend_from_slice(&s[..len]),
            (OutputValues::I64(d), Values::I64(s)) => d.extend_from_slice(&s[..len]),
            (OutputValues::U64(d), Values::U64(s)) => d.extend_from_slice(&s[..len]),
            (OutputValues::Bits(d), Values::Bool(s)) => pack(&s[..len], d),
            _ => {}
        }
        if reg.nullable {
            let rows = self.rows;
            let valid = self
                .valid
                .get_or_insert_with(|| vec![u8::MAX; rows.div_ceil(8)]);
            pack(&reg.valid[..len], valid);
        } else if let Some(valid) = &mut self.valid {
            valid.resize(valid.len() + len.div_ceil(8), u8::MAX);
        }
        self.rows += len;
    }

    fn finish(self) -> ArrayRef {
        let rows = self.rows;
        let nulls = self.valid.map(|v| NullBuffer::new(bits(v, rows)));
        match self.values {
            OutputValues::F64(v) => Arc::new(Float64Array::new(v.into_scalar_buffer(), nulls)),
            OutputValues::I64(v) => Arc::new(Int64Array::new(v.into_scalar_buffer(), nulls)),
            OutputValues::U64(v) => Arc::new(UInt64Array::new(v.into_scalar_buffer(), nulls)),
            OutputValues::Bits(v) => Arc::new(BooleanArray::new(bits(v, rows), nulls)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, StringArray, UInt8Array};
    use arrow::datatypes::Field;
    use rand::{Rng, SeedableRng};

    /// A batch with every kind the program reads, nulls sprinkled in, and awkward values
    /// (zeros, negatives, NaN, -0.0, extremes).
    fn batch(rows: usize, seed: u64) -> RecordBatch {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut maybe = |p: f64| rng.random_bool(p);
        let specials = [0.0, -0.0, f64::NAN, 1.5, -2.25, 1e300, f64::INFINITY];
        let mut rng2 = rand_chacha::ChaCha8Rng::seed_from_u64(seed + 1);
        let x: Float64Array = (0..rows)
            .map(|i| (!maybe(0.1)).then(|| specials[i % specials.len()] * (i as f64 - 50.0)))
            .collect();
        let y: Float64Array = (0..rows)
            .map(|_| (!rng2.random_bool(0.1)).then(|| rng2.random_range(-3.0..3.0)))
            .collect();
        let n: Int32Array = (0..rows)
            .map(|i| (i % 7 != 3).then_some(i as i32 % 5 - 2))
            .collect();
        let m: Int64Array = (0..rows)
            .map(|i| {
                (i % 11 != 5).then_some(if i % 13 == 0 {
                    i64::MAX
                } else {
                    i as i64 * 3 - 100
                })
            })
            .collect();
        let u: UInt8Array = (0..rows)
            .map(|i| (i % 9 != 0).then_some((i % 200) as u8))
            .collect();
        let b: BooleanArray = (0..rows)
            .map(|i| (i % 6 != 1).then_some(i % 4 < 2))
            .collect();
        let s: StringArray = (0..rows)
            .map(|i| (i % 5 != 4).then(|| ["a", "b", "c"][i % 3]))
            .collect();
        let schema = Schema::new(vec![
            Field::new("x", DataType::Float64, true),
            Field::new("y", DataType::Float64, true),
            Field::new("n", DataType::Int32, true),
            Field::new("m", DataType::Int64, true),
            Field::new("u", DataType::UInt8, true),
            Field::new("b", DataType::Boolean, true),
            Field::new("s", DataType::Utf8, true),
        ]);
        let columns: Vec<ArrayRef> = vec![
            Arc::new(x),
            Arc::new(y),
            Arc::new(n),
            Arc::new(m),
            Arc::new(u),
            Arc::new(b),
            Arc::new(s),
        ];
        RecordBatch::try_new(Arc::new(schema), columns).unwrap()
    }

    fn c(name: &str) -> Arc<Expr> {
        Arc::new(Expr::col(name))
    }
    fn f(v: f64) -> Arc<Expr> {
        Arc::new(Expr::Literal(Literal::Float64(v)))
    }
    fn i(v: i64) -> Arc<Expr> {
        Arc::new(Expr::Literal(Literal::Int64(v)))
    }
    fn bin(op: BinaryOp, lhs: Arc<Expr>, rhs: Arc<Expr>) -> Arc<Expr> {
        Arc::new(Expr::Binary { op, lhs, rhs })
    }
    fn un(op: UnaryOp, arg: Arc<Expr>) -> Arc<Expr> {
        Arc::new(Expr::Unary { op, arg })
    }

    fn expressions() -> Vec<Arc<Expr>> {
        use BinaryOp::*;
        use UnaryOp::*;
        let mut all = Vec::new();
        for op in [Add, Sub, Mul, Div, Pow, Atan2, Eq, Ne, Lt, Le, Gt, Ge] {
            all.push(bin(op, c("x"), c("y")));
            all.push(bin(op, c("n"), c("m")));
            all.push(bin(op, c("u"), f(2.5)));
            all.push(bin(op, c("m"), c("u")));
        }
        all.push(bin(Rem, c("x"), c("y")));
        all.push(bin(Rem, c("m"), i(7)));
        for op in [
            Neg, Abs, Sqrt, Exp, Log, Sin, Cos, Tan, Asin, Acos, Atan, Floor, Ceil, Round, IsNull,
            IsNotNull,
        ] {
            all.push(un(op, c("x")));
            all.push(un(op, c("n")));
        }
        all.push(un(Not, c("b")));
        for op in [And, Or] {
            all.push(bin(op, c("b"), bin(Gt, c("x"), f(0.0))));
            all.push(bin(op, bin(Lt, c("n"), i(0)), c("b")));
            all.push(bin(op, c("b"), Arc::new(Expr::Literal(Literal::Null))));
        }
        all.push(bin(Eq, c("b"), bin(Gt, c("y"), f(0.0))));
        // Strings and casts the program leaves to the kernels, inside fused expressions.
        all.push(bin(
            And,
            bin(
                Eq,
                c("s"),
                Arc::new(Expr::Literal(Literal::Utf8("a".into()))),
            ),
            c("b"),
        ));
        all.push(bin(
            Add,
            Arc::new(Expr::Cast {
                arg: c("x"),
                to: DataType::Int32,
            }),
            c("n"),
        ));
        all.push(Arc::new(Expr::Cast {
            arg: c("u"),
            to: DataType::Int64,
        }));
        all.push(Arc::new(Expr::Cast {
            arg: c("b"),
            to: DataType::Float64,
        }));
        all.push(Arc::new(Expr::FillNull {
            arg: c("x"),
            fill: c("y"),
        }));
        all.push(Arc::new(Expr::FillNull {
            arg: c("n"),
            fill: i(-1),
        }));
        all.push(Arc::new(Expr::IfElse {
            condition: c("b"),
            then: c("x"),
            otherwise: c("n"),
        }));
        all.push(Arc::new(Expr::IfElse {
            condition: bin(Gt, c("y"), f(0.0)),
            then: c("u"),
            otherwise: Arc::new(Expr::Literal(Literal::Null)),
        }));
        // The haversine pass of the taxi example.
        let rad = |e: Arc<Expr>| bin(Mul, e, f(std::f64::consts::PI / 180.0));
        let half = |e: Arc<Expr>| un(Sin, bin(Div, e, f(2.0)));
        let dlat = half(bin(Sub, rad(c("y")), rad(c("x"))));
        let a = bin(
            Add,
            bin(Mul, dlat.clone(), dlat),
            bin(Mul, un(Cos, rad(c("x"))), un(Cos, rad(c("y")))),
        );
        all.push(bin(Mul, f(2.0 * 6371.0), un(Asin, un(Sqrt, a))));
        all
    }

    #[test]
    fn the_fused_program_agrees_with_the_kernels() {
        // 2,500 rows: more than two blocks, and a partial last one.
        let batch = batch(2_500, 7);
        for expr in expressions() {
            let kernels = super::super::eval::evaluate_with_kernels(&expr, &batch);
            let fused = try_evaluate(&expr, &batch).expect("the expression is fused");
            match (kernels, fused) {
                (Ok(k), Ok(f)) => {
                    assert_eq!(k.data_type(), f.data_type(), "{expr}");
                    assert_eq!(k.logical_nulls(), f.logical_nulls(), "nulls of {expr}");
                    if k.data_type().is_floating() {
                        let (k, f) = (
                            k.as_primitive::<Float64Type>(),
                            f.as_primitive::<Float64Type>(),
                        );
                        for row in (0..k.len()).filter(|r| k.is_valid(*r)) {
                            let (a, b) = (k.value(row), f.value(row));
                            assert!(
                                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                                "{expr} row {row}: {a} vs {b}"
                            );
                        }
                    } else {
                        let (k, f) = (k.to_data(), f.to_data());
                        assert_eq!(k, f, "{expr}");
                    }
                }
                (Err(_), Err(_)) => {}
                (k, f) => panic!("{expr}: kernels {k:?}, fused {f:?}"),
            }
        }
    }

    #[test]
    fn common_subexpressions_are_computed_once() {
        let batch = batch(100, 2);
        let sin = un(UnaryOp::Sin, bin(BinaryOp::Sub, c("x"), c("y")));
        let rebuilt = un(UnaryOp::Sin, bin(BinaryOp::Sub, c("x"), c("y")));
        let e = bin(BinaryOp::Add, bin(BinaryOp::Mul, sin.clone(), sin), rebuilt);
        let schema = batch.schema();
        let mut compiler = Compiler {
            batch: &batch,
            schema: &schema,
            memo: TreeMemo::new(&schema),
            seen: HashMap::new(),
            program: Program {
                inputs: Vec::new(),
                registers: Vec::new(),
                steps: Vec::new(),
                result: 0,
                result_type: DataType::Float64,
            },
        };
        compiler.compile(&e).unwrap();
        let sines = compiler
            .program
            .steps
            .iter()
            .filter(|s| {
                matches!(
                    s,
                    Step::Unary {
                        op: UnaryOp::Sin,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(sines, 1);
        assert_eq!(
            compiler.program.inputs.len(),
            2,
            "x and y are loaded once each"
        );
    }

    #[test]
    fn plain_columns_and_string_results_are_left_to_the_kernels() {
        let batch = batch(10, 1);
        assert!(try_evaluate(&Expr::col("x"), &batch).is_none());
        let upper = Expr::IfElse {
            condition: c("b"),
            then: c("s"),
            otherwise: Arc::new(Expr::Literal(Literal::Utf8("z".into()))),
        };
        assert!(try_evaluate(&upper, &batch).is_none());
        // A column against a literal of its type: Arrow's comparison kernel.
        assert!(try_evaluate(&bin(BinaryOp::Gt, c("x"), f(0.5)), &batch).is_none());
        assert!(try_evaluate(&bin(BinaryOp::Le, f(0.5), c("x")), &batch).is_none());
        // Against another column, or needing a cast: the program.
        assert!(try_evaluate(&bin(BinaryOp::Gt, c("x"), c("y")), &batch).is_some());
        assert!(try_evaluate(&bin(BinaryOp::Gt, c("x"), i(1)), &batch).is_some());
    }

    #[test]
    fn integer_remainder_by_zero_is_an_error_naming_the_expression() {
        let batch = batch(20, 3);
        let e = bin(BinaryOp::Rem, c("m"), bin(BinaryOp::Sub, c("n"), c("n")));
        let err = try_evaluate(&e, &batch).unwrap().unwrap_err().to_string();
        assert!(
            err.contains("Divide by zero") && err.contains("col(\"m\")"),
            "{err}"
        );
    }
}
