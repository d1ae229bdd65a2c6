//! The CUDA kernels: CUDA C generated per expression ([`fused`]) or written once
//! ([`FIXED_SOURCE`]: compaction, gathers, hashing, radix sort, group-by, join), compiled to PTX
//! with NVRTC at run time and loaded into the worker's context.
//!
//! [`KernelCache`] compiles the fixed module once per worker and each fused kernel once per
//! expression shape; [`compile_ptx`] is the NVRTC step alone, which needs no GPU (the tests use
//! it to compile every kernel the generator can emit). On the emulated device the same sources
//! are compiled for the host instead ([`super::emulator`]).

pub mod fused;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use arrow::datatypes::Schema;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::detect::nvrtc_library_present;
use super::emulator::{EmulatedKernel, EmulatedModule};
use crate::expr::Expr;

/// The fixed kernels' CUDA C.
pub const FIXED_SOURCE: &str = include_str!("fixed.cu");

/// The oldest architecture the kernels support: group-by waits on slots a warp neighbour is
/// writing, which needs Volta's independent thread scheduling.
pub const MIN_ARCH: (i32, i32) = (7, 0);

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("NVRTC is not available: {0}")]
    NoNvrtc(super::detect::NoGpu),
    #[error("NVRTC failed to compile {what}: {detail}")]
    Compile { what: String, detail: String },
    #[error("loading {what} into the CUDA context failed: {detail}")]
    Load { what: String, detail: String },
    #[error("the GPU has compute capability {major}.{minor}; the kernels need 7.0 or newer")]
    TooOld { major: i32, minor: i32 },
    #[error(
        "NVRTC {nvrtc} compiles for compute capabilities {supported}: none from 7.0, the oldest the kernels support, up to this GPU's {major}.{minor} (an older NVRTC does, such as the 12.x of the nvidia-cuda-nvrtc-cu12 wheel)"
    )]
    NoArchitecture {
        nvrtc: String,
        supported: String,
        major: i32,
        minor: i32,
    },
    #[error("asking NVRTC which architectures it supports failed: {0:?}")]
    Query(cudarc::nvrtc::sys::nvrtcResult),
}

/// The compute capabilities the loaded NVRTC compiles for, oldest first (NVRTC 13 starts at
/// 7.5, 12.x at 5.0).
pub fn nvrtc_architectures() -> Result<Vec<(i32, i32)>, KernelError> {
    use cudarc::nvrtc::sys::{self, nvrtcResult};
    if !nvrtc_library_present() {
        return Err(KernelError::NoNvrtc(
            super::detect::NoGpu::NvrtcLibraryMissing,
        ));
    }
    let check = |result: nvrtcResult| match result {
        nvrtcResult::NVRTC_SUCCESS => Ok(()),
        other => Err(KernelError::Query(other)),
    };
    let mut count = 0;
    // SAFETY: NVRTC writes one int.
    check(unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) })?;
    let mut archs = vec![0; usize::try_from(count).unwrap_or(0)];
    // SAFETY: NVRTC writes `count` ints, the length of `archs`.
    check(unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) })?;
    archs.sort_unstable();
    Ok(archs.into_iter().map(|a| (a / 10, a % 10)).collect())
}

/// The loaded NVRTC's version, `major.minor` (`unknown` if it will not say). Call only where
/// NVRTC loads (after [`nvrtc_architectures`] or [`nvrtc_library_present`]).
pub fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC writes two ints.
    match unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) } {
        cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => format!("{major}.{minor}"),
        _ => "unknown".into(),
    }
}

/// The architecture to compile for on a GPU of compute capability `device`: the newest of
/// `supported` (NVRTC's) that is not newer than the GPU, whose driver compiles the PTX for the
/// GPU itself; `None` where NVRTC supports none from [`MIN_ARCH`] up to the GPU.
pub fn choose_arch(device: (i32, i32), supported: &[(i32, i32)]) -> Option<(i32, i32)> {
    supported
        .iter()
        .copied()
        .filter(|&arch| arch >= MIN_ARCH && arch <= device)
        .max()
}

/// [`choose_arch`] with the loaded NVRTC's architectures, or why none will do.
pub fn arch_for(device: (i32, i32)) -> Result<(i32, i32), KernelError> {
    let supported = nvrtc_architectures()?;
    choose_arch(device, &supported).ok_or_else(|| KernelError::NoArchitecture {
        nvrtc: nvrtc_version(),
        supported: supported
            .iter()
            .map(|(major, minor)| format!("{major}.{minor}"))
            .collect::<Vec<_>>()
            .join(", "),
        major: device.0,
        minor: device.1,
    })
}

/// NVRTC's `--gpu-architecture` value for a compute capability.
pub fn arch_option((major, minor): (i32, i32)) -> String {
    format!("--gpu-architecture=compute_{major}{minor}")
}

/// Compiles CUDA C `source` to PTX for `arch` (`--gpu-architecture=...`). `what` names the
/// module in errors. Needs `libnvrtc`, not a GPU.
pub fn compile_ptx(source: &str, arch: &str, what: &str) -> Result<Ptx, KernelError> {
    if !nvrtc_library_present() {
        return Err(KernelError::NoNvrtc(
            super::detect::NoGpu::NvrtcLibraryMissing,
        ));
    }
    let options = CompileOptions {
        options: vec![arch.to_string(), "--std=c++17".into()],
        name: Some(format!(
            "{}.cu",
            what.replace(|c: char| !c.is_alphanumeric(), "_")
        )),
        ..CompileOptions::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source, options).map_err(|e| KernelError::Compile {
        what: what.to_string(),
        detail: compile_error_text(&e),
    })
}

fn compile_error_text(error: &cudarc::nvrtc::CompileError) -> String {
    match error {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

/// How often a fused kernel came from the cache.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub compiled: u64,
}

/// A compiled kernel, ready to launch on its backend.
#[derive(Clone)]
pub enum Kernel {
    Cuda(CudaFunction),
    Emulated(EmulatedKernel),
}

/// The loaded fixed module, and how fused kernels are compiled.
enum Modules {
    Cuda {
        context: Arc<CudaContext>,
        arch: String,
        fixed: Arc<CudaModule>,
    },
    Emulated {
        fixed: Arc<EmulatedModule>,
    },
}

/// How many generated kernels [`KernelCache::plan`] keeps.
const PLANS: usize = 64;

/// An expression's generated kernel, for the table schema it was generated over.
struct Plan {
    expr: Expr,
    schema: Schema,
    kernel: Arc<fused::FusedKernel>,
}

/// The worker's compiled kernels.
pub struct KernelCache {
    modules: Modules,
    fused: Mutex<HashMap<String, Kernel>>,
    /// The kernels generated for the expressions evaluated last, most recent first: a task
    /// evaluates one expression batch after batch, and generating its source costs more than
    /// launching it.
    plans: Mutex<VecDeque<Plan>>,
    stats: Mutex<CacheStats>,
}

impl KernelCache {
    /// Compiles and loads the fixed kernels for the context's device.
    pub fn new(context: Arc<CudaContext>) -> Result<Self, KernelError> {
        let capability = context
            .compute_capability()
            .map_err(|e| KernelError::Load {
                what: "the device's compute capability".into(),
                detail: e.to_string(),
            })?;
        if capability < MIN_ARCH {
            return Err(KernelError::TooOld {
                major: capability.0,
                minor: capability.1,
            });
        }
        let arch = arch_option(arch_for(capability)?);
        let ptx = compile_ptx(FIXED_SOURCE, &arch, "wrk fixed kernels")?;
        let fixed = context.load_module(ptx).map_err(|e| KernelError::Load {
            what: "the fixed kernels".into(),
            detail: e.to_string(),
        })?;
        Ok(Self::with(Modules::Cuda {
            context,
            arch,
            fixed,
        }))
    }

    /// Compiles the fixed kernels for the emulated device.
    pub fn emulated() -> Result<Self, KernelError> {
        let fixed = EmulatedModule::compile(FIXED_SOURCE, "wrk fixed kernels")?;
        Ok(Self::with(Modules::Emulated { fixed }))
    }

    fn with(modules: Modules) -> Self {
        KernelCache {
            modules,
            fused: Mutex::new(HashMap::new()),
            plans: Mutex::new(VecDeque::new()),
            stats: Mutex::new(CacheStats::default()),
        }
    }

    /// A fixed kernel by name.
    pub fn fixed(&self, name: &str) -> Result<Kernel, KernelError> {
        match &self.modules {
            Modules::Cuda { fixed, .. } => {
                fixed
                    .load_function(name)
                    .map(Kernel::Cuda)
                    .map_err(|e| KernelError::Load {
                        what: format!("kernel `{name}`"),
                        detail: e.to_string(),
                    })
            }
            Modules::Emulated { fixed } => fixed.kernel(name).map(Kernel::Emulated),
        }
    }

    /// [`fused::generate`] of `expr` over `schema`, or the kernel generated for an identical
    /// expression and schema before.
    pub fn plan(
        &self,
        expr: &Expr,
        schema: &Schema,
    ) -> Result<Arc<fused::FusedKernel>, fused::CodegenError> {
        let lock = || self.plans.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut plans = lock();
            let found = plans
                .iter()
                .position(|plan| plan.expr.identical(expr) && plan.schema == *schema);
            if let Some(plan) = found.and_then(|position| plans.remove(position)) {
                let kernel = plan.kernel.clone();
                plans.push_front(plan);
                return Ok(kernel);
            }
        }
        let kernel = Arc::new(fused::generate(expr, schema)?);
        let mut plans = lock();
        plans.push_front(Plan {
            expr: expr.clone(),
            schema: schema.clone(),
            kernel: kernel.clone(),
        });
        plans.truncate(PLANS);
        Ok(kernel)
    }

    /// The compiled kernel of `kernel`'s shape, compiling it on first use.
    pub fn fused(&self, kernel: &fused::FusedKernel) -> Result<Kernel, KernelError> {
        if let Some(function) = self
            .fused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&kernel.shape)
        {
            self.stats.lock().unwrap_or_else(|e| e.into_inner()).hits += 1;
            return Ok(function.clone());
        }
        // Compiled outside the lock: two threads may compile one shape once each, harmlessly.
        let compiled = match &self.modules {
            Modules::Cuda { context, arch, .. } => {
                let failed = |e: cudarc::driver::DriverError| KernelError::Load {
                    what: format!("the kernel of `{}`", kernel.shape),
                    detail: e.to_string(),
                };
                let ptx = compile_ptx(&kernel.source(), arch, &kernel.shape)?;
                let module = context.load_module(ptx).map_err(failed)?;
                Kernel::Cuda(module.load_function(fused::KERNEL_NAME).map_err(failed)?)
            }
            Modules::Emulated { .. } => Kernel::Emulated(
                EmulatedModule::compile(&kernel.source(), &kernel.shape)?
                    .kernel(fused::KERNEL_NAME)?,
            ),
        };
        self.fused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(kernel.shape.clone(), compiled.clone());
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .compiled += 1;
        Ok(compiled)
    }

    pub fn stats(&self) -> CacheStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}
