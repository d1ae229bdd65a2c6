//! Kernel tests that need no GPU: every kernel the generator can emit and the fixed module
//! compiled to PTX with NVRTC (when `libnvrtc` loads; `tests/run.sh` installs it), and the
//! partition hash of `fixed.cu` compiled as host C++ and checked against the CPU backend.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int64Array, StringArray, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema};

use super::fused::{self, FusedKernel, PRELUDE};
use super::{FIXED_SOURCE, arch_option, compile_ptx};
use crate::expr::{Expr, Literal};
use crate::guest_api::wit::{BinaryOp, UnaryOp};

const TYPES: [DataType; 12] = [
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
    DataType::Null,
];

const BINARY: [BinaryOp; 15] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Rem,
    BinaryOp::Pow,
    BinaryOp::Atan2,
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
    BinaryOp::And,
    BinaryOp::Or,
];

pub(crate) const UNARY: [UnaryOp; 17] = [
    UnaryOp::Neg,
    UnaryOp::Not,
    UnaryOp::Abs,
    UnaryOp::Sqrt,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sin,
    UnaryOp::Cos,
    UnaryOp::Tan,
    UnaryOp::Asin,
    UnaryOp::Acos,
    UnaryOp::Atan,
    UnaryOp::Floor,
    UnaryOp::Ceil,
    UnaryOp::Round,
    UnaryOp::IsNull,
    UnaryOp::IsNotNull,
];

fn name(prefix: &str, t: &DataType) -> String {
    format!("{prefix}_{t}")
}

/// Two columns of every type the generator reads.
fn schema() -> Schema {
    let mut fields = Vec::new();
    for t in &TYPES {
        fields.push(Field::new(name("a", t), t.clone(), true));
        fields.push(Field::new(name("b", t), t.clone(), true));
    }
    fields.push(Field::new("text", DataType::Utf8, true));
    Schema::new(fields)
}

fn col(prefix: &str, t: &DataType) -> Arc<Expr> {
    Arc::new(Expr::col(name(prefix, t)))
}

fn literals() -> [Literal; 5] {
    [
        Literal::Float64(0.5),
        Literal::Int64(-7),
        Literal::UInt64(7),
        Literal::Boolean(true),
        Literal::Null,
    ]
}

/// One expression per node kind and operand type combination.
fn every_expression() -> Vec<(&'static str, Expr)> {
    let mut out = Vec::new();
    for op in BINARY {
        for l in &TYPES {
            for r in &TYPES {
                out.push((
                    "binary",
                    Expr::Binary {
                        op,
                        lhs: col("a", l),
                        rhs: col("b", r),
                    },
                ));
            }
            for literal in literals() {
                out.push((
                    "binary-literal",
                    Expr::Binary {
                        op,
                        lhs: col("a", l),
                        rhs: Arc::new(Expr::Literal(literal)),
                    },
                ));
            }
        }
    }
    // A string column against a string literal, either way round (only comparisons fuse).
    for op in BINARY {
        let (column, text) = (
            Arc::new(Expr::col("text")),
            Arc::new(Expr::Literal(Literal::Utf8("x\u{e9}".into()))),
        );
        for (lhs, rhs) in [(&column, &text), (&text, &column)] {
            out.push((
                "string-literal",
                Expr::Binary {
                    op,
                    lhs: lhs.clone(),
                    rhs: rhs.clone(),
                },
            ));
        }
    }
    for op in UNARY {
        for t in &TYPES {
            out.push((
                "unary",
                Expr::Unary {
                    op,
                    arg: col("a", t),
                },
            ));
        }
    }
    for t in &TYPES {
        for to in [DataType::Float64, DataType::Int64, DataType::UInt64] {
            out.push((
                "cast",
                Expr::Cast {
                    arg: col("a", t),
                    to,
                },
            ));
        }
        for u in &TYPES {
            out.push((
                "fill-null",
                Expr::FillNull {
                    arg: col("a", t),
                    fill: col("b", u),
                },
            ));
            out.push((
                "if-else",
                Expr::IfElse {
                    condition: col("a", &DataType::Boolean),
                    then: col("a", t),
                    otherwise: col("b", u),
                },
            ));
        }
    }
    out
}

/// The kernels of every expression the generator accepts, one per shape, and how many of each
/// node kind there are.
fn every_kernel() -> (Vec<FusedKernel>, BTreeMap<&'static str, usize>) {
    let schema = schema();
    let mut shapes = BTreeSet::new();
    let mut kernels = Vec::new();
    let mut per_kind: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (kind, expr) in every_expression() {
        // Type errors and nodes the CPU program does not fuse either generate nothing.
        if let Ok(kernel) = fused::generate(&expr, &schema) {
            *per_kind.entry(kind).or_default() += 1;
            if shapes.insert(kernel.shape.clone()) {
                kernels.push(kernel);
            }
        }
    }
    (kernels, per_kind)
}

#[test]
fn the_generator_covers_every_node_kind() {
    let (kernels, per_kind) = every_kernel();
    for kind in [
        "binary",
        "binary-literal",
        "string-literal",
        "unary",
        "cast",
        "fill-null",
        "if-else",
    ] {
        assert!(
            per_kind.get(kind).copied().unwrap_or(0) > 10,
            "{kind}: {per_kind:?}"
        );
    }
    assert!(kernels.len() > 1000, "{} kernels", kernels.len());
    // Every kernel of a shape generates the same source, whatever its literal values.
    for kernel in &kernels {
        assert!(
            kernel
                .source()
                .contains("extern \"C\" __global__ void __launch_bounds__(256, 7) wrk_fused(")
        );
    }
}

fn nvrtc_or_skip(test: &str) -> bool {
    if super::nvrtc_library_present() {
        return true;
    }
    let required = std::env::var("WRK_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "{test}: WRK_REQUIRE_NVRTC=1 but libnvrtc.so.12 does not load"
    );
    println!(
        "SKIPPED {test}: libnvrtc.so.12 not found (tests/run.sh installs it from the nvidia-cuda-nvrtc-cu12 wheel into target/nvrtc-venv)"
    );
    false
}

/// The kernel entry points in PTX text.
fn entries(ptx: &str) -> BTreeSet<String> {
    ptx.lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap_or(rest).trim().to_string())
        .collect()
}

#[test]
fn every_generated_kernel_compiles_to_ptx() {
    if !nvrtc_or_skip("every_generated_kernel_compiles_to_ptx") {
        return;
    }
    let (kernels, _) = every_kernel();
    // The oldest architecture the kernels and this NVRTC share (7.0 with NVRTC 12, 7.5 with 13).
    let oldest = super::nvrtc_architectures()
        .unwrap()
        .into_iter()
        .find(|&arch| arch >= super::MIN_ARCH)
        .expect("NVRTC compiles for compute capability 7.0 or newer");
    let arch = arch_option(oldest);
    // One NVRTC program per batch of kernels (each under its own name), so the thousands of
    // shapes compile in seconds; a failure names the shape.
    let mut compiled = 0;
    for (b, batch) in kernels.chunks(400).enumerate() {
        let mut source = String::from(PRELUDE);
        for (i, kernel) in batch.iter().enumerate() {
            source.push_str(&format!("// {}\n", kernel.shape));
            source.push_str(&kernel.function(&format!("k{i}")));
        }
        let ptx = compile_ptx(&source, &arch, &format!("fused batch {b}"))
            .unwrap_or_else(|e| panic!("{e}"));
        let names = entries(&ptx.to_src());
        for (i, kernel) in batch.iter().enumerate() {
            assert!(names.contains(&format!("k{i}")), "{}", kernel.shape);
        }
        compiled += batch.len();
    }
    // And one complete module exactly as the runtime compiles it.
    let ptx = compile_ptx(&kernels[0].source(), &arch, &kernels[0].shape).unwrap();
    assert!(entries(&ptx.to_src()).contains(super::fused::KERNEL_NAME));
    println!("compiled {compiled} fused kernels to PTX");
}

/// Every kernel name the host code launches: the literal names, and the per-type families.
fn launched_kernels() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for source in [
        include_str!("../exec.rs"),
        include_str!("../ops.rs"),
        include_str!("../join_index.rs"),
    ] {
        for piece in source.split('"').skip(1).step_by(2) {
            if piece.starts_with("wrk_")
                && !piece.ends_with('_')
                && piece
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                names.insert(piece.to_string());
            }
        }
    }
    let suffixes = [
        "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "f32", "f64",
    ];
    for s in suffixes {
        for family in [
            "wrk_hash_",
            "wrk_eq_word_",
            "wrk_order_word_",
            "wrk_agg_sum_",
            "wrk_agg_min_",
            "wrk_agg_max_",
        ] {
            names.insert(format!("{family}{s}"));
        }
    }
    for s in ["i8", "i16", "i32", "u8", "u16", "u32", "f32"] {
        names.insert(format!("wrk_narrow_{s}"));
    }
    names.insert("wrk_hash_str".into());
    names
}

#[test]
fn the_fixed_kernels_compile_to_ptx_with_every_kernel_the_host_launches() {
    if !nvrtc_or_skip("the_fixed_kernels_compile_to_ptx_with_every_kernel_the_host_launches") {
        return;
    }
    let launched = launched_kernels();
    assert!(launched.len() > 60, "{launched:?}");
    println!("NVRTC {}", super::nvrtc_version());
    for capability in [(7, 0), (8, 0), (9, 0)] {
        // What a GPU of this capability would compile for (7.0 is past NVRTC 13's oldest).
        let arch = match super::arch_for(capability) {
            Ok(arch) => arch,
            Err(e) if capability < (9, 0) => {
                println!("compute capability {capability:?} not compiled: {e}");
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        let ptx = compile_ptx(FIXED_SOURCE, &arch_option(arch), "wrk fixed kernels")
            .unwrap_or_else(|e| panic!("{e}"));
        let found = entries(&ptx.to_src());
        let missing: Vec<&String> = launched.difference(&found).collect();
        assert!(missing.is_empty(), "not in the PTX: {missing:?}");
    }
}

#[test]
fn the_kernels_use_the_cpu_hash_constants() {
    use crate::cpu::keys::{MIX_MULTIPLIERS, NULL_HASH};
    for constant in [NULL_HASH, MIX_MULTIPLIERS[0], MIX_MULTIPLIERS[1]] {
        let literal = format!("{constant:#x}ULL");
        assert!(FIXED_SOURCE.contains(&literal), "{literal}");
    }
    assert!(FIXED_SOURCE.contains(
        "wrk_combine(wrk_u64 h, wrk_u64 key_hash) { return wrk_mix(wrk_rotl(h, 5) ^ key_hash); }"
    ));
}

/// Builds and runs a host C++ program over `fixed.cu`'s hash section; `None` without a compiler.
fn host_hashes(program: &str) -> Option<String> {
    let compiler = ["c++", "g++", "clang++"].into_iter().find(|c| {
        std::process::Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })?;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fixed.cu"), FIXED_SOURCE).unwrap();
    std::fs::write(dir.path().join("main.cpp"), program).unwrap();
    let exe = dir.path().join("hashes");
    let status = std::process::Command::new(compiler)
        .args(["-std=c++17", "-O1", "-x", "c++"])
        .arg(dir.path().join("main.cpp"))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap();
    assert!(status.success(), "the hash section must compile as C++");
    let out = std::process::Command::new(&exe).output().unwrap();
    assert!(out.status.success());
    Some(String::from_utf8(out.stdout).unwrap())
}

#[test]
fn the_kernel_partition_hash_is_the_cpu_partition_hash() {
    let strings: Vec<String> = [
        "",
        "w",
        "wrk",
        "twelve bytes",
        "a string of exactly 32 bytes!...",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([(0..100)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect()])
    .collect();
    let ints: Vec<i64> = vec![0, 1, 42, -1, i64::MIN, i64::MAX];
    let unsigned: Vec<u64> = vec![0, 7, u64::MAX];
    let floats: Vec<f64> = vec![0.0, -0.0, 1.5, f64::NAN, -f64::NAN, f64::INFINITY, -3.25];
    let mut program =
        String::from("#include \"fixed.cu\"\n#include <cstdio>\n#include <cmath>\nint main() {\n");
    let print = |expr: String| format!("  printf(\"%llu\\n\", (unsigned long long)({expr}));\n");
    for v in &ints {
        program += &print(format!("wrk_combine(0, wrk_hash_signed((wrk_i64){v}LL))"));
    }
    for v in &unsigned {
        program += &print(format!("wrk_combine(0, wrk_hash_unsigned({v}ULL))"));
    }
    for v in &floats {
        let literal = if v.is_nan() {
            if v.is_sign_negative() {
                "-NAN".to_string()
            } else {
                "NAN".to_string()
            }
        } else if v.is_infinite() {
            "INFINITY".to_string()
        } else {
            format!("{v:?}")
        };
        program += &print(format!("wrk_combine(0, wrk_hash_float({literal}))"));
    }
    for s in &strings {
        program += &print(format!(
            "wrk_combine(0, wrk_hash_bytes((const wrk_u8*)\"{s}\", {}))",
            s.len()
        ));
    }
    // Two keys, a null first.
    program += &print(format!(
        "wrk_combine(wrk_combine(0, {:#x}ULL), wrk_hash_bytes((const wrk_u8*)\"wrk\", 3))",
        crate::cpu::keys::NULL_HASH
    ));
    program += "  return 0;\n}\n";
    let Some(output) = host_hashes(&program) else {
        println!("SKIPPED the_kernel_partition_hash_is_the_cpu_partition_hash: no C++ compiler");
        return;
    };
    let device: Vec<u64> = output.lines().map(|l| l.parse().unwrap()).collect();
    let hash = |a: ArrayRef| crate::cpu::keys::partition_hashes(&[a]).unwrap();
    let mut host = Vec::new();
    host.extend(hash(Arc::new(Int64Array::from(ints))));
    host.extend(hash(Arc::new(UInt64Array::from(unsigned))));
    host.extend(hash(Arc::new(Float64Array::from(floats))));
    host.extend(hash(Arc::new(StringArray::from(strings))));
    let nulls: ArrayRef = Arc::new(Int64Array::from(vec![None::<i64>]));
    let words: ArrayRef = Arc::new(StringArray::from(vec!["wrk"]));
    host.extend(crate::cpu::keys::partition_hashes(&[nulls, words]).unwrap());
    assert_eq!(device, host);
}

#[test]
fn a_gpu_gets_the_newest_architecture_nvrtc_has_up_to_its_own() {
    use super::choose_arch;
    let nvrtc_12 = [
        (5, 0),
        (6, 0),
        (7, 0),
        (7, 5),
        (8, 0),
        (8, 6),
        (8, 9),
        (9, 0),
        (10, 0),
    ];
    let nvrtc_13 = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)];
    assert_eq!(choose_arch((9, 0), &nvrtc_12), Some((9, 0)));
    assert_eq!(choose_arch((8, 7), &nvrtc_12), Some((8, 6)));
    // A GPU newer than NVRTC: PTX for NVRTC's newest, which the driver compiles for the GPU.
    assert_eq!(choose_arch((12, 1), &nvrtc_12), Some((10, 0)));
    assert_eq!(choose_arch((7, 0), &nvrtc_12), Some((7, 0)));
    // Volta with NVRTC 13: nothing both support.
    assert_eq!(choose_arch((7, 0), &nvrtc_13), None);
    // Older than the kernels support, whatever NVRTC can do.
    assert_eq!(choose_arch((6, 1), &nvrtc_12), None);
}

#[test]
fn no_common_architecture_names_nvrtc_its_architectures_and_the_gpu() {
    let message = super::KernelError::NoArchitecture {
        nvrtc: "13.0".into(),
        supported: "7.5, 8.0, 9.0".into(),
        major: 7,
        minor: 0,
    }
    .to_string();
    for part in [
        "NVRTC 13.0",
        "7.5, 8.0, 9.0",
        "this GPU's 7.0",
        "nvidia-cuda-nvrtc-cu12",
    ] {
        assert!(message.contains(part), "{part} in: {message}");
    }
}
