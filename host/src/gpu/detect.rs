//! Which device a worker drives: parsing `--device cpu|gpu:N|auto|emulated-gpu`, and probing for a CUDA
//! device without ever panicking.
//!
//! `cudarc` loads `libcuda` and `libnvrtc` at run time and panics inside its loader when a
//! library is missing, so every probe first asks whether the library can be loaded at all
//! (`is_culib_present`) and only then calls into it, turning each failure into a
//! [`NoGpu`] reason. A worker asked for a GPU it cannot have fails at start with that reason; a
//! worker on `auto` falls back to the CPU backend and logs it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use cudarc::driver::CudaContext;

/// The device a worker was asked to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    /// The CPU (Arrow) backend, even where a GPU exists.
    Cpu,
    /// CUDA device `N` among those visible to the process (`CUDA_VISIBLE_DEVICES`); the worker
    /// fails at start if it cannot have it.
    Gpu(u32),
    /// The first GPU if there is one, otherwise the CPU.
    #[default]
    Auto,
    /// The GPU backend on the CUDA emulator (the host CPU; needs a C++ compiler): for
    /// developing and testing the GPU path without a GPU. Slow.
    Emulated,
}

/// A `--device` value that is not `cpu`, `gpu:N`, `auto` or `emulated-gpu`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid device `{0}`: expected `cpu`, `gpu:N` (N a CUDA device number, `gpu` meaning gpu:0), `auto` or `emulated-gpu`"
)]
pub struct ParseDeviceError(String);

impl FromStr for DeviceRequest {
    type Err = ParseDeviceError;

    /// `cpu`, `auto`, `gpu` / `gpu:N`; `cuda` / `cuda:N` are accepted as synonyms of `gpu`
    /// (the Kubernetes operator sets `WRK_DEVICE=cuda` on pods that were given a GPU).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let text = s.trim().to_ascii_lowercase();
        match text.as_str() {
            "cpu" => return Ok(DeviceRequest::Cpu),
            "auto" => return Ok(DeviceRequest::Auto),
            "gpu" | "cuda" => return Ok(DeviceRequest::Gpu(0)),
            "emulated-gpu" => return Ok(DeviceRequest::Emulated),
            _ => {}
        }
        let ordinal = text
            .strip_prefix("gpu:")
            .or_else(|| text.strip_prefix("cuda:"))
            .and_then(|n| n.parse::<u32>().ok())
            .ok_or_else(|| ParseDeviceError(s.to_string()))?;
        Ok(DeviceRequest::Gpu(ordinal))
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRequest::Cpu => write!(f, "cpu"),
            DeviceRequest::Gpu(n) => write!(f, "gpu:{n}"),
            DeviceRequest::Auto => write!(f, "auto"),
            DeviceRequest::Emulated => write!(f, "emulated-gpu"),
        }
    }
}

/// Why no GPU can be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoGpu {
    #[error(
        "the CUDA driver library (libcuda.so) is not installed or not on the library path (no NVIDIA driver on this machine?)"
    )]
    DriverLibraryMissing,
    #[error(
        "the NVRTC library (libnvrtc.so.12, or libnvrtc.so for another version) is not installed or not on the library path; the GPU backend compiles its kernels with it (install the CUDA runtime's nvrtc package or the `nvidia-cuda-nvrtc-cu12` wheel and add its lib directory to LD_LIBRARY_PATH)"
    )]
    NvrtcLibraryMissing,
    #[error("the CUDA driver sees no device (is CUDA_VISIBLE_DEVICES empty?)")]
    NoDevices,
    #[error("there is no CUDA device {ordinal}: the driver sees {count}")]
    NoSuchDevice { ordinal: u32, count: u32 },
    #[error("the CUDA driver failed: {0}")]
    Driver(String),
}

/// What a worker reports about its GPU.
#[derive(Debug, Clone)]
pub struct GpuIdentity {
    pub ordinal: u32,
    /// The name the CUDA driver gives the device.
    pub name: String,
    /// `GPU-xxxxxxxx-...`, as the CUDA driver reports it (for a MIG instance this may be the
    /// parent GPU's UUID; see `nvml::nvml_lookup_keys`).
    pub uuid: String,
    pub total_memory: u64,
    pub compute_capability: (i32, i32),
}

/// What the probe found: a CUDA device with a live context.
#[derive(Clone)]
pub struct ProbedGpu {
    pub identity: GpuIdentity,
    pub context: Arc<CudaContext>,
}

impl fmt::Debug for ProbedGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.identity.fmt(f)
    }
}

/// Whether `libcuda` can be loaded (without loading it through cudarc's panicking loader).
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to `dlopen` the library by its candidate names and drops the handle.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether `libnvrtc` can be loaded.
pub fn nvrtc_library_present() -> bool {
    // SAFETY: as for `driver_library_present`.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Opens CUDA device `ordinal`: checks that the driver and NVRTC libraries load, then creates
/// the device's primary context. Never panics.
pub fn probe(ordinal: u32) -> Result<ProbedGpu, NoGpu> {
    if !driver_library_present() {
        return Err(NoGpu::DriverLibraryMissing);
    }
    let driver = |e: cudarc::driver::DriverError| NoGpu::Driver(e.to_string());
    let count = CudaContext::device_count().map_err(driver)?;
    let count = u32::try_from(count).unwrap_or(0);
    if count == 0 {
        return Err(NoGpu::NoDevices);
    }
    if ordinal >= count {
        return Err(NoGpu::NoSuchDevice { ordinal, count });
    }
    if !nvrtc_library_present() {
        return Err(NoGpu::NvrtcLibraryMissing);
    }
    let context = CudaContext::new(ordinal as usize).map_err(driver)?;
    let name = context.name().map_err(driver)?;
    let uuid = format_uuid(&context.uuid().map_err(driver)?.bytes);
    let total_memory = context.total_mem().map_err(driver)? as u64;
    let compute_capability = context.compute_capability().map_err(driver)?;
    Ok(ProbedGpu {
        identity: GpuIdentity {
            ordinal,
            name,
            uuid,
            total_memory,
            compute_capability,
        },
        context,
    })
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, the form NVML and `nvidia-smi` use.
pub fn format_uuid(bytes: &[std::ffi::c_char; 16]) -> String {
    let hex: Vec<String> = bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex[0..4].concat(),
        hex[4..6].concat(),
        hex[6..8].concat(),
        hex[8..10].concat(),
        hex[10..16].concat()
    )
}

/// The outcome of device selection, before the GPU runtime is started.
#[derive(Debug)]
pub enum Selected {
    /// The CPU backend, and why (for the log).
    Cpu {
        reason: String,
    },
    Gpu(ProbedGpu),
    /// The CUDA emulator was asked for.
    Emulated,
}

/// A GPU was asked for and cannot be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--device {request} was asked for but no GPU can be used: {reason}")]
pub struct DeviceUnavailable {
    pub request: DeviceRequest,
    pub reason: NoGpu,
}

/// Chooses the device for `request`, probing with `probe_device` (the real [`probe`] in the
/// worker; tests pass their own).
pub fn select(
    request: DeviceRequest,
    probe_device: impl FnOnce(u32) -> Result<ProbedGpu, NoGpu>,
) -> Result<Selected, DeviceUnavailable> {
    match request {
        DeviceRequest::Cpu => Ok(Selected::Cpu {
            reason: "--device cpu was asked for".into(),
        }),
        DeviceRequest::Emulated => Ok(Selected::Emulated),
        DeviceRequest::Gpu(ordinal) => probe_device(ordinal)
            .map(Selected::Gpu)
            .map_err(|reason| DeviceUnavailable { request, reason }),
        DeviceRequest::Auto => Ok(match probe_device(0) {
            Ok(gpu) => Selected::Gpu(gpu),
            Err(reason) => Selected::Cpu {
                reason: format!("--device auto found no usable GPU: {reason}"),
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_requests_parse() {
        assert_eq!("cpu".parse(), Ok(DeviceRequest::Cpu));
        assert_eq!("auto".parse(), Ok(DeviceRequest::Auto));
        assert_eq!("gpu".parse(), Ok(DeviceRequest::Gpu(0)));
        assert_eq!("gpu:3".parse(), Ok(DeviceRequest::Gpu(3)));
        assert_eq!(" GPU:1 ".parse(), Ok(DeviceRequest::Gpu(1)));
        assert_eq!("cuda".parse(), Ok(DeviceRequest::Gpu(0)));
        assert_eq!("cuda:2".parse(), Ok(DeviceRequest::Gpu(2)));
        for bad in ["", "gpu:", "gpu:-1", "gpu:x", "tpu", "gpu:1:2"] {
            let err = bad.parse::<DeviceRequest>().unwrap_err().to_string();
            assert!(err.contains("expected `cpu`, `gpu:N`"), "{bad}: {err}");
        }
        assert_eq!("emulated-gpu".parse(), Ok(DeviceRequest::Emulated));
        for request in [
            DeviceRequest::Cpu,
            DeviceRequest::Gpu(7),
            DeviceRequest::Auto,
            DeviceRequest::Emulated,
        ] {
            assert_eq!(request.to_string().parse(), Ok(request));
        }
    }

    #[test]
    fn uuids_print_like_nvidia_smi() {
        let bytes: [std::ffi::c_char; 16] = std::array::from_fn(|i| (i * 17) as u8 as _);
        assert_eq!(
            format_uuid(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }

    #[test]
    fn probing_without_a_driver_reports_why_and_does_not_panic() {
        // On a machine with a GPU this opens it; here (no driver) it must say why not.
        match probe(0) {
            Ok(gpu) => assert!(!gpu.identity.name.is_empty()),
            Err(reason) => {
                assert!(!driver_library_present() || reason != NoGpu::DriverLibraryMissing);
                println!("no GPU here: {reason}");
            }
        }
        if !driver_library_present() {
            assert_eq!(probe(0).unwrap_err(), NoGpu::DriverLibraryMissing);
            assert_eq!(probe(5).unwrap_err(), NoGpu::DriverLibraryMissing);
        }
    }

    #[test]
    fn auto_falls_back_to_cpu_and_an_explicit_gpu_fails() {
        let missing = |_| Err(NoGpu::DriverLibraryMissing);
        match select(DeviceRequest::Auto, missing) {
            Ok(Selected::Cpu { reason }) => {
                assert!(reason.contains("auto found no usable GPU"), "{reason}");
                assert!(reason.contains("libcuda.so"), "{reason}");
            }
            other => panic!("auto without a GPU gave {other:?}"),
        }
        let err = select(DeviceRequest::Gpu(0), missing).unwrap_err();
        assert_eq!(err.request, DeviceRequest::Gpu(0));
        let message = err.to_string();
        assert!(
            message.contains("--device gpu:0 was asked for but no GPU can be used"),
            "{message}"
        );
        let err = select(DeviceRequest::Gpu(2), |ordinal| {
            Err(NoGpu::NoSuchDevice { ordinal, count: 1 })
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("no CUDA device 2: the driver sees 1"),
            "{err}"
        );
        let never = |_| -> Result<ProbedGpu, NoGpu> { panic!("cpu must not probe") };
        assert!(matches!(
            select(DeviceRequest::Cpu, never),
            Ok(Selected::Cpu { .. })
        ));
    }

    #[test]
    fn the_real_probe_agrees_with_the_libraries_present() {
        // `select` with the real probe: here, without libcuda, auto is cpu and gpu:0 an error.
        let auto = select(DeviceRequest::Auto, probe).unwrap();
        let explicit = select(DeviceRequest::Gpu(0), probe);
        if driver_library_present() {
            println!("a CUDA driver is present: auto chose {auto:?}");
        } else {
            assert!(matches!(auto, Selected::Cpu { .. }));
            assert!(explicit.is_err());
        }
    }
}
