//! A CUDA device emulated on the CPU, for running the GPU backend where there is no GPU.
//!
//! The kernels' CUDA C (the fixed module and every generated fused kernel) is compiled unchanged
//! by the host C++ compiler against [`HEADER`], which provides CUDA's execution model: each CUDA
//! thread of a block is an OS thread, `__syncthreads` and warp shuffles are barriers, atomics are
//! the compiler's builtins. The resulting shared library is loaded with `libloading`, and every
//! launch goes through the same host code (`exec`, `ops`, `table`) as on a GPU, with the pool's
//! buffers in host memory.
//!
//! It is slow (a thread per CUDA thread) and it is not a GPU: it does not model lock-step warps,
//! memory spaces or timing. It exists so that the device operators run, and are compared with
//! the CPU backend, on every machine that builds `wrk` (`--device emulated-gpu`, and the GPU
//! tests when no GPU is found).

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::kernels::KernelError;

/// The CUDA execution model in C++, included by every emulated module.
const HEADER: &str = include_str!("cuda_on_cpu.h");

/// The emulated device's name and UUID, as a worker reports them.
pub const DEVICE_NAME: &str = "CUDA emulator (host CPU)";
pub const DEVICE_UUID: &str = "EMULATED-GPU";

/// The host C++ compiler: `$CXX`, else `c++`.
fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// The host C++ compiler's `--version` output, asked once per process; `None` if it does not
/// run.
fn compiler_version() -> Option<&'static [u8]> {
    static VERSION: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            Command::new(compiler())
                .arg("--version")
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| o.stdout)
        })
        .as_deref()
}

/// Whether the host C++ compiler runs (the emulator compiles every kernel with it).
pub fn compiler_present() -> bool {
    compiler_version().is_some()
}

/// For tests of the emulator: true, after printing a skip line for `test`, when there is no
/// C++ compiler to run it.
#[cfg(test)]
pub(crate) fn skipped_without_compiler(test: &str) -> bool {
    let skipped = !compiler_present();
    if skipped {
        println!("SKIPPED {test}: no C++ compiler for the CUDA emulator (`c++` or $CXX)");
    }
    skipped
}

/// The exported launcher of one kernel: `args[i]` points at the kernel's i-th argument.
type Launcher = unsafe extern "C" fn(args: *mut *mut c_void, grid: u32, block: u32) -> i32;

/// Marks a kernel in the preprocessed source (`__global__` expands to it).
const KERNEL_MARK: &str = "__attribute__((used)) void ";

/// One compiled module: a loaded shared library with a launcher per kernel.
pub struct EmulatedModule {
    what: String,
    launchers: HashMap<String, Launcher>,
    // Kept loaded for as long as a launcher may be called.
    _library: libloading::Library,
}

/// A kernel of an [`EmulatedModule`], ready to launch.
#[derive(Clone)]
pub struct EmulatedKernel {
    name: String,
    launcher: Launcher,
    _module: Arc<EmulatedModule>,
}

impl EmulatedModule {
    /// Compiles CUDA C `source` (`what` names it in errors), or returns the module compiled from
    /// the same source earlier in this process.
    pub fn compile(source: &str, what: &str) -> Result<Arc<EmulatedModule>, KernelError> {
        static MODULES: OnceLock<Mutex<HashMap<String, Arc<EmulatedModule>>>> = OnceLock::new();
        let modules = MODULES.get_or_init(Mutex::default);
        if let Some(module) = modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(source)
        {
            return Ok(module.clone());
        }
        let module = Arc::new(Self::build(source, what)?);
        modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(source.to_string(), module.clone());
        Ok(module)
    }

    fn build(source: &str, what: &str) -> Result<EmulatedModule, KernelError> {
        let failed = |detail: String| KernelError::Compile {
            what: format!("{what} (CUDA emulator)"),
            detail,
        };
        let header_dir = header_dir().map_err(failed)?;
        let include = format!("-I{}", header_dir.display());
        let dir = ScratchDir::new().map_err(|e| failed(format!("a scratch directory: {e}")))?;
        let kernels_file = dir.path().join("kernels.cpp");
        let body = format!("#include \"cuda_on_cpu.h\"\n{source}\n");
        std::fs::write(&kernels_file, &body).map_err(|e| failed(e.to_string()))?;
        // The kernels' names, from the preprocessed source (macros generate some of them).
        let preprocessed =
            run_compiler(&["-E", "-P", &include], &kernels_file, None).map_err(failed)?;
        let kernels = kernels_in(&preprocessed);
        if kernels.is_empty() {
            return Err(failed("the source defines no kernel".into()));
        }
        let mut launchers = body;
        for (name, synchronising) in &kernels {
            launchers.push_str(&format!(
                "extern \"C\" int wrk_emu_launch_{name}(void** args, unsigned grid, unsigned block) {{ return wrk_emu::launch(&{name}, args, grid, block, {synchronising}); }}\n"
            ));
        }
        let module_file = dir.path().join("module.cpp");
        std::fs::write(&module_file, launchers).map_err(|e| failed(e.to_string()))?;
        let library_file = dir.path().join("module.so");
        run_compiler(
            &[&include, "-shared", "-fPIC", "-pthread"],
            &module_file,
            Some(&library_file),
        )
        .map_err(failed)?;
        // SAFETY: the library is the one just compiled from our kernels and the header, whose
        // initialisers only set up plain globals.
        let library = unsafe { libloading::Library::new(&library_file) }
            .map_err(|e| failed(format!("loading the compiled module: {e}")))?;
        let mut found = HashMap::new();
        for (name, _) in kernels {
            let symbol = format!("wrk_emu_launch_{name}");
            // SAFETY: every `wrk_emu_launch_*` is defined above with the `Launcher` signature.
            let launcher: Launcher = unsafe { library.get::<Launcher>(symbol.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| failed(format!("the launcher of `{name}`: {e}")))?;
            found.insert(name, launcher);
        }
        Ok(EmulatedModule {
            what: what.to_string(),
            launchers: found,
            _library: library,
        })
    }

    /// The kernel `name` of this module.
    pub fn kernel(self: &Arc<Self>, name: &str) -> Result<EmulatedKernel, KernelError> {
        let launcher = *self.launchers.get(name).ok_or_else(|| KernelError::Load {
            what: format!("kernel `{name}`"),
            detail: format!("{} (CUDA emulator) has no such kernel", self.what),
        })?;
        Ok(EmulatedKernel {
            name: name.to_string(),
            launcher,
            _module: self.clone(),
        })
    }
}

impl EmulatedKernel {
    /// Runs the kernel over `grid` blocks of `block` threads and waits for it.
    ///
    /// # Safety
    /// `args` must point at values of the kernel's parameter types, in order, and every
    /// address among them must be valid for what the kernel touches.
    pub unsafe fn launch(
        &self,
        grid: u32,
        block: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), String> {
        // SAFETY: the caller's contract; the launcher joins every thread before returning.
        let status = unsafe { (self.launcher)(args.as_mut_ptr(), grid, block) };
        match status {
            0 => Ok(()),
            -1 => Err(format!(
                "`{}`: the emulator could not start {block} threads",
                self.name
            )),
            -3 => Err(format!(
                "`{}`: the threads of a block deadlocked at a barrier (`__syncthreads` or a shuffle not reached by every thread)",
                self.name
            )),
            _ => Err(format!(
                "`{}`: a launch of {grid} blocks of {block} threads is not valid",
                self.name
            )),
        }
    }
}

/// The kernels (`extern "C" __global__` functions) in preprocessed source, each with whether
/// its body synchronises its block or shares memory in it: `__syncthreads`, warp shuffles, or a
/// `static` variable (what `__shared__` expands to; kernels have no other statics). The kernels
/// call no helper that synchronises; a kernel that did would run as independent threads and
/// deadlock or fail its comparisons, not pass silently.
fn kernels_in(preprocessed: &str) -> Vec<(String, bool)> {
    let mut kernels: Vec<(String, bool)> = preprocessed
        .match_indices(KERNEL_MARK)
        .filter_map(|(at, _)| {
            let rest = preprocessed[at + KERNEL_MARK.len()..].trim_start();
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                return None;
            }
            let body = function_body(rest);
            let synchronising = ["__syncthreads", "__shfl_", "static "]
                .iter()
                .any(|marker| body.contains(marker));
            Some((name, synchronising))
        })
        .collect();
    kernels.sort();
    kernels.dedup();
    kernels
}

/// The text from the first `{` of `source` to its matching `}` (or to the end).
fn function_body(source: &str) -> &str {
    let Some(start) = source.find('{') else {
        return "";
    };
    let mut depth = 0usize;
    for (i, c) in source[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &source[start..start + i + 1];
                }
            }
            _ => {}
        }
    }
    &source[start..]
}

/// Runs the C++ compiler on `input` with `flags`; its output file, or stdout without one.
fn run_compiler(flags: &[&str], input: &Path, output: Option<&Path>) -> Result<String, String> {
    let mut command = Command::new(compiler());
    command.args(COMMON_FLAGS).args(flags).arg(input);
    if let Some(output) = output {
        command.arg("-o").arg(output);
    }
    let run = command
        .output()
        .map_err(|e| format!("running the C++ compiler `{}`: {e}", compiler()))?;
    if !run.status.success() {
        return Err(format!(
            "the C++ compiler failed ({}): {}",
            run.status,
            String::from_utf8_lossy(&run.stderr)
        ));
    }
    String::from_utf8(run.stdout).map_err(|e| format!("the compiler's output: {e}"))
}

/// The flags of every compilation (the precompiled header is only used with the same ones).
/// `_FORTIFY_SOURCE`, which some distributions' compilers define by default (Ubuntu's), turns
/// `_longjmp` into a checked one that aborts the process when it jumps to another stack, which
/// is how the emulator switches between a block's threads.
const COMMON_FLAGS: [&str; 5] = [
    "-std=c++20",
    "-w",
    "-O2",
    "-U_FORTIFY_SOURCE",
    "-D_FORTIFY_SOURCE=0",
];

/// The directory holding [`HEADER`] and, where the compiler makes one, its precompiled form
/// (`.gch`), which takes a module's compilation from about a second to a third of one. It is
/// shared by every process with the same header, compiler and flags:
/// `$XDG_CACHE_HOME/wrk/cuda-emulator/<key>` (else under `$HOME/.cache`, else the temporary
/// directory). Files are written under temporary names and renamed, so processes starting
/// together do not see each other's half-written files. Without a precompiled header (another
/// compiler, a failed build) the header is simply parsed each time.
fn header_dir() -> Result<&'static Path, String> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(prepare_header_dir)
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(Clone::clone)
}

fn prepare_header_dir() -> Result<PathBuf, String> {
    let version = compiler_version()
        .ok_or_else(|| format!("the C++ compiler `{}` does not run", compiler()))?;
    let key = crate::engine::module_hash(
        &[
            HEADER.as_bytes(),
            version,
            COMMON_FLAGS.join(" ").as_bytes(),
        ]
        .concat(),
    );
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join("wrk").join("cuda-emulator").join(&key[..16]);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let unique = format!(
        "{}.{}",
        std::process::id(),
        NEXT_SCRATCH.fetch_add(1, Ordering::Relaxed)
    );
    let header = dir.join("cuda_on_cpu.h");
    if !header.exists() {
        let temporary = dir.join(format!("cuda_on_cpu.h.{unique}"));
        std::fs::write(&temporary, HEADER)
            .and_then(|()| std::fs::rename(&temporary, &header))
            .map_err(|e| format!("writing {}: {e}", header.display()))?;
    }
    let precompiled = dir.join("cuda_on_cpu.h.gch");
    if !precompiled.exists() {
        let temporary = dir.join(format!("cuda_on_cpu.h.gch.{unique}"));
        let built = run_compiler(
            &["-x", "c++-header", "-fPIC", "-pthread"],
            &header,
            Some(&temporary),
        )
        .and_then(|_| std::fs::rename(&temporary, &precompiled).map_err(|e| e.to_string()));
        if let Err(e) = built {
            let _ = std::fs::remove_file(&temporary);
            tracing::debug!("the CUDA emulator runs without a precompiled header: {e}");
        }
    }
    Ok(dir)
}

static NEXT_SCRATCH: AtomicU64 = AtomicU64::new(0);

/// A directory of its own under the system's temporary directory, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> std::io::Result<Self> {
        let path = std::env::temp_dir().join(format!(
            "wrk-cuda-emulator-{}-{}",
            std::process::id(),
            NEXT_SCRATCH.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path)?;
        Ok(ScratchDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = r#"
extern "C" __global__ void block_prefix(const unsigned* in, unsigned* out, long long n) {
    __shared__ unsigned warp_sums[32];
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    unsigned v = i < n ? in[i] : 0u, x = v, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= (unsigned)o) x += y;
    }
    if (lane == 31u) warp_sums[warp] = x;
    __syncthreads();
    unsigned before = 0;
    for (unsigned w = 0; w < warp; ++w) before += warp_sums[w];
    if (i < n) out[i] = before + x;
}
extern "C" __global__ void mismatched_barriers(unsigned* out) {
    unsigned v = threadIdx.x;
    if (threadIdx.x == 0) {
        __syncthreads();
    } else {
        v = __shfl_up_sync(0xffffffffu, v, 1);
        __syncthreads();
    }
    out[threadIdx.x] = v;
}
extern "C" __global__ void count_into(unsigned long long* total, double* sum, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {
        atomicAdd(total, 1ULL);
        atomicAdd(sum, 0.5);
    }
}
"#;

    #[test]
    fn the_execution_model_runs_barriers_shuffles_and_atomics() {
        if skipped_without_compiler("the_execution_model_runs_barriers_shuffles_and_atomics") {
            return;
        }
        let module = EmulatedModule::compile(SOURCE, "the emulator test").unwrap();
        // An inclusive prefix sum per block of 128 threads over 300 values: warp shuffles,
        // `__shared__` and `__syncthreads`, with a last block that is partly past the end.
        let input: Vec<u32> = (0..300).map(|i| i % 7).collect();
        let mut output = vec![0u32; 300];
        let mut n = 300i64;
        let (mut a, mut b) = (input.as_ptr() as u64, output.as_mut_ptr() as u64);
        let mut args = [
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut n as *mut i64).cast(),
        ];
        let kernel = module.kernel("block_prefix").unwrap();
        unsafe { kernel.launch(3, 128, &mut args) }.unwrap();
        for (block, chunk) in input.chunks(128).enumerate() {
            let mut running = 0;
            for (k, v) in chunk.iter().enumerate() {
                running += v;
                assert_eq!(output[block * 128 + k], running, "block {block} row {k}");
            }
        }
        // Atomics from many threads, over a grid-stride loop.
        let (mut total, mut sum) = (0u64, 0f64);
        let mut n = 100_000i64;
        let (mut t, mut s) = (&mut total as *mut u64 as u64, &mut sum as *mut f64 as u64);
        let mut args = [
            (&mut t as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
            (&mut n as *mut i64).cast(),
        ];
        let kernel = module.kernel("count_into").unwrap();
        unsafe { kernel.launch(4, 256, &mut args) }.unwrap();
        assert_eq!((total, sum), (100_000, 50_000.0));
        // Thread 0 waits at `__syncthreads` while its warp waits for it at a shuffle.
        let mut out = vec![0u32; 32];
        let mut o = out.as_mut_ptr() as u64;
        let mut args = [(&mut o as *mut u64).cast()];
        let err = unsafe {
            module
                .kernel("mismatched_barriers")
                .unwrap()
                .launch(1, 32, &mut args)
        }
        .unwrap_err();
        assert!(err.contains("deadlocked at a barrier"), "{err}");
        // Bad launches and unknown kernels are errors, not crashes.
        let kernel = module.kernel("count_into").unwrap();
        assert!(unsafe { kernel.launch(1, 2048, &mut args) }.is_err());
        let err = module.kernel("missing").err().unwrap().to_string();
        assert!(err.contains("no such kernel"), "{err}");
    }

    #[test]
    fn kernels_that_synchronise_or_share_are_told_apart() {
        let source = "extern \"C\" __attribute__((used)) void a(int* x) { if (x) { x[0] = 1; } }\n\
            extern \"C\" __attribute__((used)) void b(int* x) { static int s[4]; { s[0] = x[0]; } }\n\
            extern \"C\" __attribute__((used)) void c(int* x) { __syncthreads(); }\n\
            extern \"C\" __attribute__((used)) void d(int* x) { x[0] = __shfl_up_sync(0u, x[0], 1); }\n";
        assert_eq!(
            kernels_in(source),
            vec![
                ("a".to_string(), false),
                ("b".to_string(), true),
                ("c".to_string(), true),
                ("d".to_string(), true)
            ]
        );
    }

    #[test]
    fn broken_source_is_a_compile_error_naming_the_module() {
        if skipped_without_compiler("broken_source_is_a_compile_error_naming_the_module") {
            return;
        }
        let err = EmulatedModule::compile("extern \"C\" __global__ void k( {", "a broken module")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("a broken module (CUDA emulator)"), "{err}");
    }
}
