//! Fused expression kernels: one CUDA C kernel generated per expression from the host's
//! expression tree, evaluating the whole tree per row in registers (one pass over the inputs,
//! one write of the result).
//!
//! The generator fuses exactly the nodes the CPU backend's fused program fuses
//! (`cpu::fused::fusible`: numbers and booleans) with the same semantics: values widen to
//! `double`, `long long`, `unsigned long long` or `bool`; integer arithmetic wraps; an integer
//! remainder by a valid zero is an error; floats compare by IEEE total order (as
//! `f64::total_cmp`); nulls propagate, `and`/`or` follow Kleene logic; casts convert as the CPU
//! program does. One node more than the CPU program: a string column compared with a string
//! literal (`borough == "Manhattan"`, byte order as Arrow's comparison kernels, which the CPU
//! backend runs for it), so such a filter stays one kernel. Anything else (other string
//! expressions, dates, narrowing casts) is refused with [`CodegenError::Unsupported`] and
//! stays on the CPU backend.
//!
//! Kernels are cached by *shape*: the expression with its columns replaced by their position and
//! type and its literals by their kind (`($0:Float64 > ?f64)`); literal values are kernel
//! parameters, so `fare > 10` and `fare > 20` share one compiled kernel.

use std::collections::HashMap;
use std::fmt::Write as _;

use arrow::datatypes::{DataType, Schema};

use super::super::exec::BLOCK;
use crate::cpu::fused::fusible_typed;
use crate::expr::{Expr, Literal, TreeMemo, common_type, numeric_result};
use crate::guest_api::wit::{BinaryOp, UnaryOp};

/// The blocks of [`BLOCK`] threads a fused kernel must fit on a multiprocessor at once: the
/// compiler keeps its registers to 65,536 / (7 x 256) = 36 a thread. A kernel heavy in
/// arithmetic waits on its loads half of the time, and more resident threads hide that: the
/// haversine's kernel used 38 registers (6 blocks) and took 0.270 ms over 20 M rows on an H200
/// (0.309 ms on an H100), and 0.247 ms (0.280 ms) with 7; 8 gave no more. A kernel of few
/// registers (a column sum: 32) is not changed by it.
pub const MIN_BLOCKS: u32 = 7;

/// The name of the kernel in a generated module.
pub const KERNEL_NAME: &str = "wrk_fused";

/// Helpers every fused kernel uses.
pub const PRELUDE: &str = r#"// wrk fused-expression kernels (generated).
#ifndef WRK_FUSED_PRELUDE
#define WRK_FUSED_PRELUDE
// -1, 0 or 1 as f64::total_cmp orders a and b (IEEE 754 totalOrder).
__device__ __forceinline__ int wrk_cmp_f64(double a, double b) {
    long long x = __double_as_longlong(a);
    long long y = __double_as_longlong(b);
    x ^= (long long)(((unsigned long long)(x >> 63)) >> 1);
    y ^= (long long)(((unsigned long long)(y >> 63)) >> 1);
    return (x > y) - (x < y);
}
__device__ __forceinline__ int wrk_cmp_i64(long long a, long long b) { return (a > b) - (a < b); }
__device__ __forceinline__ int wrk_cmp_u64(unsigned long long a, unsigned long long b) {
    return (a > b) - (a < b);
}
__device__ __forceinline__ int wrk_cmp_bool(bool a, bool b) { return (int)a - (int)b; }
// -1, 0 or 1 as byte strings order (Rust's `str` order, Arrow's string comparisons).
__device__ __forceinline__ int wrk_cmp_str(const unsigned char* a, int a_len, const unsigned char* b, int b_len) {
    int common = a_len < b_len ? a_len : b_len;
    for (int k = 0; k < common; k++) {
        if (a[k] != b[k]) return a[k] < b[k] ? -1 : 1;
    }
    return (a_len > b_len) - (a_len < b_len);
}
#endif
"#;

/// The register kinds of the generated code (those of the CPU program).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    F64,
    I64,
    U64,
    Bool,
}

impl Kind {
    pub fn of(data_type: &DataType) -> Option<Kind> {
        use DataType::*;
        Some(match data_type {
            Float32 | Float64 => Kind::F64,
            Int8 | Int16 | Int32 | Int64 => Kind::I64,
            UInt8 | UInt16 | UInt32 | UInt64 => Kind::U64,
            Boolean | Null => Kind::Bool,
            _ => return None,
        })
    }

    pub fn data_type(self) -> DataType {
        match self {
            Kind::F64 => DataType::Float64,
            Kind::I64 => DataType::Int64,
            Kind::U64 => DataType::UInt64,
            Kind::Bool => DataType::Boolean,
        }
    }

    fn c_type(self) -> &'static str {
        match self {
            Kind::F64 => "double",
            Kind::I64 => "long long",
            Kind::U64 => "unsigned long long",
            Kind::Bool => "bool",
        }
    }

    /// The C type of an output element (booleans are stored one byte per row).
    pub fn storage_type(self) -> &'static str {
        match self {
            Kind::Bool => "unsigned char",
            other => other.c_type(),
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Kind::F64 => "f64",
            Kind::I64 => "i64",
            Kind::U64 => "u64",
            Kind::Bool => "bool",
        }
    }
}

/// The C element type of a device column of `data_type` (booleans one byte per row), or `None`
/// for types the fused kernels do not read.
pub fn column_storage_type(data_type: &DataType) -> Option<&'static str> {
    use DataType::*;
    Some(match data_type {
        Float64 => "double",
        Float32 => "float",
        Int8 => "signed char",
        Int16 => "short",
        Int32 => "int",
        Int64 => "long long",
        UInt8 => "unsigned char",
        UInt16 => "unsigned short",
        UInt32 => "unsigned int",
        UInt64 => "unsigned long long",
        Boolean => "unsigned char",
        // A null column has no values: its pointer is passed as null and never read.
        Null => "unsigned char",
        _ => return None,
    })
}

/// A literal passed to the kernel as a parameter.
#[derive(Debug, Clone, PartialEq)]
pub enum LiteralArg {
    F64(f64),
    I64(i64),
    U64(u64),
    /// Passed as an `int` (0 or 1).
    Bool(bool),
    /// Passed as its bytes in device memory and their length (`lit{j}`, `lit{j}_len`).
    Str(String),
}

/// A column the kernel reads: parameters `in{k}` (values) and `valid{k}` (one byte per row,
/// null when every row is valid); a string column has its offsets `off{k}` first. The kernel
/// of a column its schema declares not nullable never reads `valid{k}`.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedInput {
    pub column: String,
    pub data_type: DataType,
    pub nullable: bool,
}

/// A generated kernel and what to launch it with. Its parameters, in order: `long long n`,
/// `int* error`, then `in{k}, valid{k}` per input, then one value per literal, then `out` and
/// `out_valid` (one byte per row). `error` is written only by a kernel that [`may_fail`], and
/// `out_valid` only by one whose result is [`nullable`]; either may be null otherwise.
///
/// [`may_fail`]: FusedKernel::may_fail
/// [`nullable`]: FusedKernel::nullable
#[derive(Debug, Clone, PartialEq)]
pub struct FusedKernel {
    /// The cache key: the normalised expression text with input types.
    pub shape: String,
    pub inputs: Vec<FusedInput>,
    pub literals: Vec<LiteralArg>,
    /// The kind of the result column (its Arrow type is `output.data_type()`).
    pub output: Kind,
    /// Whether a row of the result can be null (a nullable input or literal, or a conversion
    /// out of range); the kernel writes `out_valid` only then.
    pub nullable: bool,
    /// Whether the kernel can set `error` (an integer remainder by zero); only then does the
    /// caller need to read it back, which waits for the kernel.
    pub may_fail: bool,
    /// The kernel function, named by the caller (see [`FusedKernel::function`]).
    body: String,
}

impl FusedKernel {
    /// The kernel function named `name` and the row function it calls, `{name}_row`
    /// (without the prelude).
    pub fn function(&self, name: &str) -> String {
        self.body.replace("__KERNEL_NAME__", name)
    }

    /// A copy whose source has `from` replaced by `to`, its shape marked with `tag`: a variant
    /// the benchmark compiles and times beside the generated kernel.
    #[cfg(test)]
    pub(crate) fn variant(&self, tag: &str, from: &str, to: &str) -> FusedKernel {
        FusedKernel {
            shape: format!("{} variant {tag}", self.shape),
            body: self.body.replace(from, to),
            ..self.clone()
        }
    }

    /// The complete CUDA C source of the module: prelude and the kernel [`KERNEL_NAME`].
    pub fn source(&self) -> String {
        format!("{PRELUDE}\n{}", self.function(KERNEL_NAME))
    }
}

/// Why an expression has no fused kernel.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodegenError {
    #[error("the GPU backend does not fuse `{expr}`: {detail}")]
    Unsupported { expr: String, detail: String },
    #[error(transparent)]
    Type(#[from] crate::expr::ExprError),
}

/// Generates the fused kernel of `expr` over a table of `schema`. A column whose field is not
/// nullable must have no nulls: its validity is not read.
pub fn generate(expr: &Expr, schema: &Schema) -> Result<FusedKernel, CodegenError> {
    let result_type = expr.data_type(schema)?;
    let mut generator = Generator {
        schema,
        memo: TreeMemo::new(schema),
        inputs: Vec::new(),
        literals: Vec::new(),
        code: String::new(),
        seen: HashMap::new(),
        nullable: Vec::new(),
        may_fail: false,
    };
    let (result, kind) = generator.node(expr)?;
    if kind.data_type() != result_type {
        return Err(unsupported(
            expr,
            format!(
                "its result type {result_type} is not one a kernel register holds ({})",
                kind.data_type()
            ),
        ));
    }
    // The parameters, declared by the kernel and by the row function it calls, and passed on.
    let mut params = String::from("long long n, int* error");
    let mut args = String::from("n, error");
    for (k, input) in generator.inputs.iter().enumerate() {
        if input.data_type == DataType::Utf8 {
            let _ = write!(params, ", const int* __restrict__ off{k}");
            let _ = write!(args, ", off{k}");
        }
        let ty = column_storage_type(&input.data_type).unwrap_or("unsigned char");
        let _ = write!(
            params,
            ", const {ty}* __restrict__ in{k}, const unsigned char* __restrict__ valid{k}"
        );
        let _ = write!(args, ", in{k}, valid{k}");
    }
    for (j, literal) in generator.literals.iter().enumerate() {
        let ty = match literal {
            LiteralArg::F64(_) => "double",
            LiteralArg::I64(_) => "long long",
            LiteralArg::U64(_) => "unsigned long long",
            LiteralArg::Bool(_) => "int",
            LiteralArg::Str(_) => {
                let _ = write!(
                    params,
                    ", const unsigned char* __restrict__ lit{j}, int lit{j}_len"
                );
                let _ = write!(args, ", lit{j}, lit{j}_len");
                continue;
            }
        };
        let _ = write!(params, ", {ty} lit{j}");
        let _ = write!(args, ", lit{j}");
    }
    let _ = write!(
        params,
        ", {}* __restrict__ out, unsigned char* __restrict__ out_valid",
        kind.storage_type()
    );
    args.push_str(", out, out_valid");
    let nullable = generator.nullable[result];
    let mut body = String::new();
    let _ = writeln!(
        body,
        "// Row i: the whole expression in registers.\n\
         static __device__ __forceinline__ void __KERNEL_NAME___row(long long i, {params}) {{"
    );
    body.push_str(&generator.code);
    let _ = writeln!(body, "        out[i] = ({})x{result};", kind.storage_type());
    if nullable {
        let _ = writeln!(body, "        out_valid[i] = m{result} ? 1 : 0;");
    }
    let _ = writeln!(
        body,
        "}}\n\
         extern \"C\" __global__ void __launch_bounds__({BLOCK}, {MIN_BLOCKS}) __KERNEL_NAME__({params}) {{\n\
         \x20   // Each thread takes rows i, i + stride, i + 2 stride...: two at a time while both\n\
         \x20   // exist, so that the loads and arithmetic of the two overlap. The grid's size\n\
         \x20   // decides how many rows a thread takes.\n\
         \x20   long long stride = (long long)blockDim.x * gridDim.x;\n\
         \x20   long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n\
         \x20   for (; i + stride < n; i += 2 * stride) {{\n\
         \x20       __KERNEL_NAME___row(i, {args});\n\
         \x20       __KERNEL_NAME___row(i + stride, {args});\n\
         \x20   }}\n\
         \x20   if (i < n) __KERNEL_NAME___row(i, {args});\n\
         }}"
    );
    let shape = {
        let types: Vec<String> = generator
            .inputs
            .iter()
            .map(|i| {
                let null = if i.nullable { "nullable " } else { "" };
                format!("{null}{}", i.data_type)
            })
            .collect();
        format!("{} [{}]", shape_text(expr, schema), types.join(", "))
    };
    Ok(FusedKernel {
        shape,
        inputs: generator.inputs,
        literals: generator.literals,
        output: kind,
        nullable,
        may_fail: generator.may_fail,
        body,
    })
}

fn unsupported(expr: &Expr, detail: impl Into<String>) -> CodegenError {
    CodegenError::Unsupported {
        expr: expr.to_string(),
        detail: detail.into(),
    }
}

/// The expression with columns as `$position:type` (in order of first use) and literals as
/// their kind: two expressions of one shape compile to the same kernel.
pub fn shape_text(expr: &Expr, schema: &Schema) -> String {
    fn walk(expr: &Expr, schema: &Schema, columns: &mut Vec<String>, out: &mut String) {
        match expr {
            Expr::Column(name) => {
                let position = columns.iter().position(|c| c == name).unwrap_or_else(|| {
                    columns.push(name.clone());
                    columns.len() - 1
                });
                let data_type = schema
                    .field_with_name(name)
                    .map(|f| f.data_type().to_string())
                    .unwrap_or_else(|_| "?".into());
                let _ = write!(out, "${position}:{data_type}");
            }
            Expr::Literal(literal) => out.push_str(match literal {
                Literal::Null => "null",
                Literal::Boolean(_) => "?bool",
                Literal::Int64(_) => "?i64",
                Literal::UInt64(_) => "?u64",
                Literal::Float64(_) => "?f64",
                Literal::Utf8(_) => "?str",
            }),
            Expr::Binary { op, lhs, rhs } => {
                let _ = write!(out, "{}(", op_name(op));
                walk(lhs, schema, columns, out);
                out.push_str(", ");
                match exact_divisor(*op, rhs) {
                    Some(_) => out.push_str("?2^k"),
                    None => walk(rhs, schema, columns, out),
                }
                out.push(')');
            }
            Expr::Unary { op, arg } => {
                let _ = write!(out, "{}(", op_name(op));
                walk(arg, schema, columns, out);
                out.push(')');
            }
            Expr::Cast { arg, to } => {
                out.push_str("cast(");
                walk(arg, schema, columns, out);
                let _ = write!(out, " as {to})");
            }
            Expr::FillNull { arg, fill } => {
                out.push_str("fill_null(");
                walk(arg, schema, columns, out);
                out.push_str(", ");
                walk(fill, schema, columns, out);
                out.push(')');
            }
            Expr::IfElse {
                condition,
                then,
                otherwise,
            } => {
                out.push_str("if_else(");
                walk(condition, schema, columns, out);
                out.push_str(", ");
                walk(then, schema, columns, out);
                out.push_str(", ");
                walk(otherwise, schema, columns, out);
                out.push(')');
            }
        }
    }
    let mut out = String::new();
    walk(expr, schema, &mut Vec::new(), &mut out);
    out
}

/// `1 / v` where `op` divides by the literal `v` and multiplying by `1 / v` gives exactly the
/// quotient: `v` a power of two whose reciprocal is a normal double. Both are then the one
/// correctly rounded value of the same real number, and the multiplication is several times
/// cheaper than a double division on a GPU (whose divisor, a kernel parameter, the compiler
/// cannot see).
fn exact_divisor(op: BinaryOp, rhs: &Expr) -> Option<f64> {
    let v = match (op, rhs) {
        (BinaryOp::Div, Expr::Literal(literal)) => match *literal {
            Literal::Float64(v) => v,
            Literal::Int64(v) if v.unsigned_abs().is_power_of_two() => v as f64,
            Literal::UInt64(v) if v.is_power_of_two() => v as f64,
            _ => return None,
        },
        _ => return None,
    };
    const MANTISSA: u64 = (1 << 52) - 1;
    let reciprocal = 1.0 / v;
    (v.is_normal() && v.to_bits() & MANTISSA == 0 && reciprocal.is_normal()).then_some(reciprocal)
}

/// The C test that turns a three-way comparison (-1, 0, 1) into `op`'s answer (`== 0` for
/// `Eq`), or `None` when `op` is not a comparison.
fn comparison_test(op: BinaryOp) -> Option<&'static str> {
    use BinaryOp::*;
    Some(match op {
        Eq => "== 0",
        Ne => "!= 0",
        Lt => "< 0",
        Le => "<= 0",
        Gt => "> 0",
        Ge => ">= 0",
        _ => return None,
    })
}

/// `Gt` for `BinaryOp::Gt` (the bindings' `Debug` may qualify the name).
fn op_name(op: &impl std::fmt::Debug) -> String {
    let name = format!("{op:?}");
    name.rsplit("::").next().unwrap_or(&name).to_string()
}

struct Generator<'a> {
    schema: &'a Schema,
    /// The expression's node numbers and types.
    memo: TreeMemo<'a>,
    inputs: Vec<FusedInput>,
    literals: Vec<LiteralArg>,
    /// The loop body: one `x{n}` (value) and `m{n}` (valid) pair per node.
    code: String,
    /// The variable of every subexpression generated so far, by its node number.
    seen: HashMap<usize, (usize, Kind)>,
    /// Per variable: whether its `m` can be false (a variable that cannot be null lets the
    /// compiler drop the null logic that depends on it).
    nullable: Vec<bool>,
    may_fail: bool,
}

impl<'a> Generator<'a> {
    fn type_of(&mut self, expr: &'a Expr) -> Result<DataType, CodegenError> {
        Ok(self.memo.data_type(expr)?)
    }

    /// Whether `column`'s values can be null: a `Null` column, or a field declared nullable.
    fn nullable_column(&self, column: &str) -> bool {
        self.schema.field_with_name(column).map_or(true, |f| {
            f.is_nullable() || *f.data_type() == DataType::Null
        })
    }

    /// Declares a new value/valid pair of `kind`, zero-initialised and valid.
    fn declare(&mut self, kind: Kind) -> usize {
        let v = self.nullable.len();
        self.nullable.push(false);
        let _ = writeln!(
            self.code,
            "        {} x{v} = 0; bool m{v} = true;",
            kind.c_type()
        );
        v
    }

    fn line(&mut self, text: String) {
        self.code.push_str("        ");
        self.code.push_str(&text);
        self.code.push('\n');
    }

    /// Generates `expr` once; a repeated subexpression reuses its first variable.
    fn node(&mut self, expr: &'a Expr) -> Result<(usize, Kind), CodegenError> {
        let key = self.memo.id(expr);
        if let Some(&found) = self.seen.get(&key) {
            return Ok(found);
        }
        let generated = self.generate(expr)?;
        self.seen.insert(key, generated);
        Ok(generated)
    }

    /// `v` converted to `to`, as the CPU program's `convert` step does.
    fn convert(&mut self, (v, from): (usize, Kind), to: Kind) -> usize {
        if from == to {
            return v;
        }
        let d = self.declare(to);
        // Arrow's cast makes u64 values beyond i64 null; narrowing conversions are never
        // planned (as in the CPU program) and give null.
        let (value, makes_nulls) = match (from, to) {
            (Kind::I64 | Kind::U64, Kind::F64) => (format!("x{d} = (double)x{v};"), false),
            (Kind::Bool, Kind::F64) => (format!("x{d} = x{v} ? 1.0 : 0.0;"), false),
            (Kind::U64, Kind::I64) => (
                format!(
                    "if (x{v} > 9223372036854775807ULL) {{ m{d} = false; }} else {{ x{d} = (long long)x{v}; }}"
                ),
                true,
            ),
            (Kind::Bool, Kind::I64 | Kind::U64) => (format!("x{d} = x{v} ? 1 : 0;"), false),
            (Kind::F64, Kind::Bool) => (format!("x{d} = x{v} != 0.0;"), false),
            (Kind::I64 | Kind::U64, Kind::Bool) => (format!("x{d} = x{v} != 0;"), false),
            _ => (format!("m{d} = false;"), true),
        };
        self.line(format!("m{d} = m{v};"));
        self.line(value);
        self.nullable[d] = makes_nulls || self.nullable[v];
        d
    }

    /// The input index of column `name` of type `data_type`, added on first use.
    fn input(&mut self, name: &str, data_type: &DataType) -> usize {
        match self.inputs.iter().position(|i| i.column == name) {
            Some(k) => k,
            None => {
                self.inputs.push(FusedInput {
                    column: name.to_string(),
                    data_type: data_type.clone(),
                    nullable: self.nullable_column(name),
                });
                self.inputs.len() - 1
            }
        }
    }

    /// A string column compared with a string literal, either way round; `None` for any
    /// other node.
    fn string_comparison(&mut self, expr: &Expr) -> Option<Result<(usize, Kind), CodegenError>> {
        use BinaryOp::*;
        let Expr::Binary { op, lhs, rhs } = expr else {
            return None;
        };
        let (column, text, op) = match (lhs.as_ref(), rhs.as_ref()) {
            (Expr::Column(c), Expr::Literal(Literal::Utf8(t))) => (c, t, *op),
            // `"x" < s` is `s > "x"`.
            (Expr::Literal(Literal::Utf8(t)), Expr::Column(c)) => (
                c,
                t,
                match op {
                    Lt => Gt,
                    Le => Ge,
                    Gt => Lt,
                    Ge => Le,
                    other => *other,
                },
            ),
            _ => return None,
        };
        let test = comparison_test(op)?;
        match self.schema.field_with_name(column) {
            Ok(f) if *f.data_type() == DataType::Utf8 => {}
            _ => return None,
        }
        let k = self.input(column, &DataType::Utf8);
        let j = self.literals.len();
        self.literals.push(LiteralArg::Str(text.clone()));
        let d = self.declare(Kind::Bool);
        self.read_validity(d, k);
        self.line(format!(
            "if (m{d}) x{d} = wrk_cmp_str(in{k} + off{k}[i], off{k}[i + 1] - off{k}[i], lit{j}, lit{j}_len) {test};"
        ));
        Some(Ok((d, Kind::Bool)))
    }

    /// `m{d}`: whether input `k` is valid in this row, read only where it can be null.
    fn read_validity(&mut self, d: usize, k: usize) {
        if self.inputs[k].nullable {
            self.line(format!("m{d} = valid{k} == 0 || valid{k}[i] != 0;"));
            self.nullable[d] = true;
        }
    }

    fn generate(&mut self, expr: &'a Expr) -> Result<(usize, Kind), CodegenError> {
        if let Some(generated) = self.string_comparison(expr) {
            return generated;
        }
        if !fusible_typed(expr, |e| self.memo.data_type(e).ok()) {
            let data_type = self.type_of(expr)?;
            return Err(unsupported(
                expr,
                format!("no fused form for a node of type {data_type}"),
            ));
        }
        match expr {
            Expr::Column(name) => {
                let data_type = self.type_of(expr)?;
                let kind = Kind::of(&data_type)
                    .ok_or_else(|| unsupported(expr, format!("cannot read {data_type}")))?;
                let k = self.input(name, &data_type);
                let d = self.declare(kind);
                if data_type == DataType::Null {
                    self.line(format!("m{d} = false;"));
                    self.nullable[d] = true;
                } else {
                    self.read_validity(d, k);
                    let read = if kind == Kind::Bool {
                        format!("x{d} = in{k}[i] != 0;")
                    } else {
                        format!("x{d} = ({})in{k}[i];", kind.c_type())
                    };
                    self.line(read);
                }
                Ok((d, kind))
            }
            Expr::Literal(literal) => {
                let (kind, arg) = match literal {
                    Literal::Null => (Kind::Bool, None),
                    Literal::Boolean(v) => (Kind::Bool, Some(LiteralArg::Bool(*v))),
                    Literal::Int64(v) => (Kind::I64, Some(LiteralArg::I64(*v))),
                    Literal::UInt64(v) => (Kind::U64, Some(LiteralArg::U64(*v))),
                    Literal::Float64(v) => (Kind::F64, Some(LiteralArg::F64(*v))),
                    Literal::Utf8(_) => return Err(unsupported(expr, "string literals")),
                };
                let d = self.declare(kind);
                match arg {
                    None => {
                        self.line(format!("m{d} = false;"));
                        self.nullable[d] = true;
                    }
                    Some(arg) => {
                        let j = self.literals.len();
                        self.literals.push(arg);
                        let value = if kind == Kind::Bool {
                            format!("x{d} = lit{j} != 0;")
                        } else {
                            format!("x{d} = lit{j};")
                        };
                        self.line(value);
                    }
                }
                Ok((d, kind))
            }
            Expr::Binary { op, lhs, rhs } => self.binary(expr, *op, lhs, rhs),
            Expr::Unary { op, arg } => self.unary(expr, *op, arg),
            Expr::Cast { arg, to } => {
                let kind = Kind::of(to).ok_or_else(|| unsupported(expr, "cast target"))?;
                let src = self.node(arg)?;
                Ok((self.convert(src, kind), kind))
            }
            Expr::FillNull { arg, fill } => {
                let kind = self.result_kind(expr)?;
                let (src, fill) = (self.node(arg)?, self.node(fill)?);
                let (s, f) = (self.convert(src, kind), self.convert(fill, kind));
                let d = self.declare(kind);
                self.line(format!(
                    "if (m{s}) {{ x{d} = x{s}; m{d} = true; }} else {{ x{d} = x{f}; m{d} = m{f}; }}"
                ));
                self.nullable[d] = self.nullable[s] && self.nullable[f];
                Ok((d, kind))
            }
            Expr::IfElse {
                condition,
                then,
                otherwise,
            } => {
                let kind = self.result_kind(expr)?;
                let cond = self.node(condition)?;
                let c = self.convert(cond, Kind::Bool);
                let (then, otherwise) = (self.node(then)?, self.node(otherwise)?);
                let (t, o) = (self.convert(then, kind), self.convert(otherwise, kind));
                let d = self.declare(kind);
                self.line(format!(
                    "if (x{c}) {{ x{d} = x{t}; m{d} = m{c} && m{t}; }} else {{ x{d} = x{o}; m{d} = m{c} && m{o}; }}"
                ));
                self.nullable[d] = self.nullable[c] || self.nullable[t] || self.nullable[o];
                Ok((d, kind))
            }
        }
    }

    fn result_kind(&mut self, expr: &'a Expr) -> Result<Kind, CodegenError> {
        let data_type = self.type_of(expr)?;
        Kind::of(&data_type).ok_or_else(|| unsupported(expr, format!("result type {data_type}")))
    }

    fn binary(
        &mut self,
        expr: &'a Expr,
        op: BinaryOp,
        lhs: &'a Expr,
        rhs: &'a Expr,
    ) -> Result<(usize, Kind), CodegenError> {
        use BinaryOp::*;
        if let Some(reciprocal) = exact_divisor(op, rhs) {
            let a = self.node(lhs)?;
            let a = self.convert(a, Kind::F64);
            let j = self.literals.len();
            self.literals.push(LiteralArg::F64(reciprocal));
            let d = self.declare(Kind::F64);
            self.line(format!("m{d} = m{a}; x{d} = x{a} * lit{j};"));
            self.nullable[d] = self.nullable[a];
            return Ok((d, Kind::F64));
        }
        let (left_type, right_type) = (self.type_of(lhs)?, self.type_of(rhs)?);
        let operand_type = match op {
            Add | Sub | Mul | Rem => numeric_result(&left_type, &right_type),
            Div | Pow | Atan2 => Some(DataType::Float64),
            Eq | Ne | Lt | Le | Gt | Ge => common_type(&left_type, &right_type),
            And | Or => Some(DataType::Boolean),
        };
        let operand = operand_type
            .as_ref()
            .and_then(Kind::of)
            .ok_or_else(|| unsupported(expr, format!("operands {left_type} and {right_type}")))?;
        let (a, b) = (self.node(lhs)?, self.node(rhs)?);
        let (a, b) = (self.convert(a, operand), self.convert(b, operand));
        let comparison = comparison_test(op);
        let logic = matches!(op, And | Or);
        let result = if comparison.is_some() || logic {
            Kind::Bool
        } else {
            operand
        };
        let d = self.declare(result);
        self.nullable[d] = self.nullable[a] || self.nullable[b];
        if logic {
            let and = op == And;
            let (join, decides) = if and { ("&&", "false") } else { ("||", "true") };
            self.line(format!("x{d} = x{a} {join} x{b};"));
            // Kleene: a valid side equal to the deciding value decides alone.
            self.line(format!(
                "m{d} = m{a} && m{b}; if (!m{d} && ((m{a} && x{a} == {decides}) || (m{b} && x{b} == {decides}))) {{ m{d} = true; x{d} = {decides}; }}"
            ));
            return Ok((d, result));
        }
        self.line(format!("m{d} = m{a} && m{b};"));
        if let Some(test) = comparison {
            self.line(format!(
                "x{d} = wrk_cmp_{}(x{a}, x{b}) {test};",
                operand.tag()
            ));
            return Ok((d, result));
        }
        let code = match (operand, op) {
            (Kind::F64, Add) => format!("x{d} = x{a} + x{b};"),
            (Kind::F64, Sub) => format!("x{d} = x{a} - x{b};"),
            (Kind::F64, Mul) => format!("x{d} = x{a} * x{b};"),
            (Kind::F64, Div) => format!("x{d} = x{a} / x{b};"),
            (Kind::F64, Rem) => format!("x{d} = fmod(x{a}, x{b});"),
            (Kind::F64, Pow) => format!("x{d} = pow(x{a}, x{b});"),
            (Kind::F64, Atan2) => format!("x{d} = atan2(x{a}, x{b});"),
            (Kind::I64, Add | Sub | Mul) => {
                let symbol = match op {
                    Add => "+",
                    Sub => "-",
                    _ => "*",
                };
                format!(
                    "x{d} = (long long)((unsigned long long)x{a} {symbol} (unsigned long long)x{b});"
                )
            }
            (Kind::I64, Rem) => {
                self.may_fail = true;
                format!(
                    "if (x{b} == 0) {{ if (m{b}) atomicExch(error, 1); }} else if (x{b} == -1) {{ x{d} = 0; }} else {{ x{d} = x{a} % x{b}; }}"
                )
            }
            (Kind::U64, Add) => format!("x{d} = x{a} + x{b};"),
            (Kind::U64, Sub) => format!("x{d} = x{a} - x{b};"),
            (Kind::U64, Mul) => format!("x{d} = x{a} * x{b};"),
            (Kind::U64, Rem) => {
                self.may_fail = true;
                format!(
                    "if (x{b} == 0) {{ if (m{b}) atomicExch(error, 1); }} else {{ x{d} = x{a} % x{b}; }}"
                )
            }
            _ => {
                return Err(unsupported(
                    expr,
                    format!("{op:?} on {} operands", operand.tag()),
                ));
            }
        };
        self.line(code);
        Ok((d, result))
    }

    fn unary(
        &mut self,
        expr: &'a Expr,
        op: UnaryOp,
        arg: &'a Expr,
    ) -> Result<(usize, Kind), CodegenError> {
        use UnaryOp::*;
        let input_type = self.type_of(arg)?;
        let src = self.node(arg)?;
        let (operand, result) = match op {
            IsNull | IsNotNull => (src.1, Kind::Bool),
            Not => (Kind::Bool, Kind::Bool),
            Neg | Abs => {
                let kind = numeric_result(&input_type, &input_type)
                    .as_ref()
                    .and_then(Kind::of)
                    .ok_or_else(|| unsupported(expr, format!("{op:?} of {input_type}")))?;
                (kind, kind)
            }
            _ => (Kind::F64, Kind::F64),
        };
        let s = self.convert(src, operand);
        let d = self.declare(result);
        let code = match (op, operand) {
            (IsNull, _) => format!("x{d} = !m{s};"),
            (IsNotNull, _) => format!("x{d} = m{s};"),
            (Not, _) => format!("m{d} = m{s}; x{d} = !x{s};"),
            (Neg, Kind::I64) => {
                format!("m{d} = m{s}; x{d} = (long long)(0ULL - (unsigned long long)x{s});")
            }
            (Abs, Kind::I64) => format!(
                "m{d} = m{s}; x{d} = x{s} < 0 ? (long long)(0ULL - (unsigned long long)x{s}) : x{s};"
            ),
            (Neg, Kind::F64) => format!("m{d} = m{s}; x{d} = -x{s};"),
            (Abs, Kind::F64) => format!("m{d} = m{s}; x{d} = fabs(x{s});"),
            (math, Kind::F64) => {
                let function = match math {
                    Sqrt => "sqrt",
                    Exp => "exp",
                    Log => "log",
                    Sin => "sin",
                    Cos => "cos",
                    Tan => "tan",
                    Asin => "asin",
                    Acos => "acos",
                    Atan => "atan",
                    Floor => "floor",
                    Ceil => "ceil",
                    // CUDA's round, like f64::round, rounds half away from zero.
                    _ => "round",
                };
                format!("m{d} = m{s}; x{d} = {function}(x{s});")
            }
            _ => {
                return Err(unsupported(
                    expr,
                    format!("{op:?} of a {} value", operand.tag()),
                ));
            }
        };
        self.line(code);
        self.nullable[d] = !matches!(op, IsNull | IsNotNull) && self.nullable[s];
        Ok((d, result))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use arrow::datatypes::Field;
    use std::sync::Arc;

    pub(crate) fn bin(op: BinaryOp, lhs: Expr, rhs: Expr) -> Expr {
        Expr::Binary {
            op,
            lhs: Arc::new(lhs),
            rhs: Arc::new(rhs),
        }
    }

    pub(crate) fn un(op: UnaryOp, arg: Expr) -> Expr {
        Expr::Unary {
            op,
            arg: Arc::new(arg),
        }
    }

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("fare", DataType::Float64, true),
            Field::new("km", DataType::Float32, true),
            Field::new("passengers", DataType::Int32, true),
            Field::new("count", DataType::UInt32, true),
            Field::new("vendor", DataType::Utf8, true),
            Field::new("day", DataType::Date32, true),
        ])
    }

    #[test]
    fn a_comparison_with_a_literal_reads_one_column_and_one_parameter() {
        let e = bin(
            BinaryOp::Gt,
            Expr::col("fare"),
            Expr::Literal(Literal::Float64(10.0)),
        );
        let k = generate(&e, &schema()).unwrap();
        assert_eq!(k.shape, "Gt($0:Float64, ?f64) [nullable Float64]");
        assert_eq!(k.literals, vec![LiteralArg::F64(10.0)]);
        assert_eq!(k.output, Kind::Bool);
        let source = k.source();
        assert!(source.contains("extern \"C\" __global__ void __launch_bounds__(256, 7) wrk_fused(long long n, int* error, const double* __restrict__ in0, const unsigned char* __restrict__ valid0, double lit0, unsigned char* __restrict__ out, unsigned char* __restrict__ out_valid)"), "{source}");
        assert!(source.contains("x0 = (double)in0[i];"), "{source}");
        assert!(source.contains("x2 = wrk_cmp_f64(x0, x1) > 0;"), "{source}");
    }

    /// A column declared without nulls has its validity left unread, and a result that cannot
    /// be null has none written; a nullable column, a null literal or a conversion out of
    /// range brings both back.
    #[test]
    fn only_what_can_be_null_reads_or_writes_validity() {
        let schema = Schema::new(vec![
            Field::new("x", DataType::Float64, false),
            Field::new("n", DataType::Float64, true),
            Field::new("u", DataType::UInt64, false),
            Field::new("i", DataType::Int64, false),
        ]);
        let sum = |a: Expr, b: Expr| bin(BinaryOp::Add, a, b);
        let lit = |v: f64| Expr::Literal(Literal::Float64(v));
        let dense = generate(&sum(Expr::col("x"), lit(1.0)), &schema).unwrap();
        assert_eq!(dense.shape, "Add($0:Float64, ?f64) [Float64]");
        assert!(!dense.nullable);
        let source = dense.source();
        assert!(!source.contains("valid0["), "{source}");
        assert!(!source.contains("out_valid["), "{source}");
        let cases = [
            sum(Expr::col("x"), Expr::col("n")),
            sum(Expr::col("x"), Expr::Literal(Literal::Null)),
            sum(
                Expr::col("i"),
                Expr::Cast {
                    arg: Arc::new(Expr::col("u")),
                    to: DataType::Int64,
                },
            ),
        ];
        for e in cases {
            let k = generate(&e, &schema).unwrap();
            assert!(k.nullable, "{e}");
            assert!(k.source().contains("out_valid[i] = "), "{e}");
        }
        // Testing for null makes a value that is never null.
        let test = un(UnaryOp::IsNull, Expr::col("n"));
        let k = generate(&test, &schema).unwrap();
        assert!(!k.nullable);
        assert!(k.source().contains("valid0[i]"));
        // The same expression over a nullable column is another kernel.
        let nullable = Schema::new(vec![Field::new("x", DataType::Float64, true)]);
        let k = generate(&sum(Expr::col("x"), lit(1.0)), &nullable).unwrap();
        assert_ne!(k.shape, dense.shape);
        assert!(k.nullable);
    }

    /// A division by a power of two is a multiplication by its reciprocal (the same quotient,
    /// to the bit); any other divisor is a division. Only an integer remainder can fail.
    #[test]
    fn a_division_by_a_power_of_two_multiplies_and_only_a_remainder_may_fail() {
        let divided =
            |divisor: Literal| bin(BinaryOp::Div, Expr::col("fare"), Expr::Literal(divisor));
        for (divisor, reciprocal) in [
            (Literal::Float64(2.0), 0.5),
            (Literal::Float64(-0.25), -4.0),
            (Literal::Int64(-8), -0.125),
            (Literal::UInt64(1 << 20), 1.0 / (1u64 << 20) as f64),
        ] {
            let k = generate(&divided(divisor.clone()), &schema()).unwrap();
            assert_eq!(k.shape, "Div($0:Float64, ?2^k) [nullable Float64]");
            assert_eq!(k.literals, vec![LiteralArg::F64(reciprocal)], "{divisor:?}");
            let source = k.source();
            assert!(source.contains("* lit0;"), "{source}");
            assert!(!source.contains(" / "), "{source}");
            assert!(!k.may_fail);
        }
        for divisor in [
            Literal::Float64(3.0),
            Literal::Float64(0.0),
            Literal::Float64(f64::INFINITY),
            Literal::Float64(f64::NAN),
            // Its reciprocal, 2^-1023, is not a normal double.
            Literal::Float64(2f64.powi(1023)),
            Literal::Float64(5e-324),
            Literal::Int64(6),
            Literal::Int64(0),
            Literal::Null,
        ] {
            let k = generate(&divided(divisor.clone()), &schema()).unwrap();
            assert!(!k.shape.contains("2^k"), "{divisor:?}: {}", k.shape);
            assert!(k.source().contains(" / "), "{divisor:?}");
        }
        let remainder = bin(
            BinaryOp::Rem,
            Expr::col("passengers"),
            Expr::Literal(Literal::Int64(3)),
        );
        assert!(generate(&remainder, &schema()).unwrap().may_fail);
        let float_remainder = bin(BinaryOp::Rem, Expr::col("fare"), Expr::col("km"));
        assert!(!generate(&float_remainder, &schema()).unwrap().may_fail);
    }

    #[test]
    fn literals_and_column_names_do_not_change_the_shape() {
        let a = bin(
            BinaryOp::Mul,
            Expr::col("fare"),
            Expr::Literal(Literal::Float64(2.0)),
        );
        let b = bin(
            BinaryOp::Mul,
            Expr::col("fare"),
            Expr::Literal(Literal::Float64(3.5)),
        );
        let (ka, kb) = (
            generate(&a, &schema()).unwrap(),
            generate(&b, &schema()).unwrap(),
        );
        assert_eq!(ka.shape, kb.shape);
        assert_eq!(ka.source(), kb.source());
        assert_ne!(ka.literals, kb.literals);
        // A different input type is a different kernel.
        let c = bin(
            BinaryOp::Mul,
            Expr::col("km"),
            Expr::Literal(Literal::Float64(2.0)),
        );
        assert_ne!(generate(&c, &schema()).unwrap().shape, ka.shape);
    }

    #[test]
    fn integer_arithmetic_wraps_and_remainder_checks_its_divisor() {
        let e = bin(
            BinaryOp::Rem,
            bin(
                BinaryOp::Add,
                Expr::col("passengers"),
                Expr::Literal(Literal::Int64(1)),
            ),
            Expr::col("passengers"),
        );
        let k = generate(&e, &schema()).unwrap();
        let source = k.source();
        assert!(
            source.contains("(unsigned long long)x0 + (unsigned long long)x1"),
            "{source}"
        );
        assert!(source.contains("if (m0) atomicExch(error, 1);"), "{source}");
        // The repeated column is read once.
        assert_eq!(k.inputs.len(), 1);
        assert_eq!(source.matches("in0[i]").count(), 1, "{source}");
    }

    #[test]
    fn haversine_is_one_kernel() {
        let rad = |c: &str| {
            bin(
                BinaryOp::Mul,
                Expr::col(c),
                Expr::Literal(Literal::Float64(std::f64::consts::PI / 180.0)),
            )
        };
        let half_sin_sq = |a: Expr, b: Expr| {
            let s = un(
                UnaryOp::Sin,
                bin(
                    BinaryOp::Div,
                    bin(BinaryOp::Sub, a, b),
                    Expr::Literal(Literal::Float64(2.0)),
                ),
            );
            bin(BinaryOp::Mul, s.clone(), s)
        };
        let a = bin(
            BinaryOp::Add,
            half_sin_sq(rad("fare"), rad("km")),
            bin(
                BinaryOp::Mul,
                un(UnaryOp::Cos, rad("fare")),
                un(UnaryOp::Cos, rad("km")),
            ),
        );
        let e = bin(
            BinaryOp::Mul,
            Expr::Literal(Literal::Float64(2.0 * 6371.0)),
            un(UnaryOp::Asin, un(UnaryOp::Sqrt, a)),
        );
        let k = generate(&e, &schema()).unwrap();
        assert_eq!(k.inputs.len(), 2);
        assert_eq!(k.output, Kind::F64);
        let source = k.source();
        // The repeated sin(...) is computed once.
        assert_eq!(source.matches("= sin(").count(), 1, "{source}");
        assert_eq!(source.matches("= cos(").count(), 2, "{source}");
    }

    #[test]
    fn kleene_logic_and_null_tests() {
        let e = bin(
            BinaryOp::Or,
            un(UnaryOp::IsNull, Expr::col("fare")),
            un(
                UnaryOp::Not,
                bin(BinaryOp::Lt, Expr::col("passengers"), Expr::col("count")),
            ),
        );
        let k = generate(&e, &schema()).unwrap();
        let source = k.source();
        assert!(source.contains("x1 = !m0;"), "{source}");
        // Int32 vs UInt32 compare as Int64: the unsigned side converts with its range check.
        assert!(source.contains("9223372036854775807ULL"), "{source}");
        assert!(source.contains("== true) || (m"), "{source}");
    }

    #[test]
    fn strings_dates_and_narrow_casts_are_left_to_the_cpu() {
        let cases = [
            // Strings other than a column against a literal.
            bin(BinaryOp::Eq, Expr::col("vendor"), Expr::col("vendor")),
            Expr::Literal(Literal::Utf8("x".into())),
            Expr::Cast {
                arg: Arc::new(Expr::col("day")),
                to: DataType::Int64,
            },
            Expr::Cast {
                arg: Arc::new(Expr::col("fare")),
                to: DataType::Int32,
            },
            // A bare narrow column: its value is the column itself.
            Expr::col("passengers"),
        ];
        for e in cases {
            let err = generate(&e, &schema()).unwrap_err();
            assert!(
                matches!(err, CodegenError::Unsupported { .. }),
                "{e}: {err}"
            );
        }
        let err = generate(&Expr::col("nope"), &schema()).unwrap_err();
        assert!(matches!(err, CodegenError::Type(_)), "{err}");
    }
}
