//! NVML telemetry of the worker's GPU: name, memory, SM utilisation, PCIe and NVLink throughput,
//! temperature and power, and the MIG profile when the worker was given a MIG instance.
//!
//! NVML is loaded at run time (`nvml-wrapper`); without the driver `Nvml::init` returns an error
//! and the worker runs without telemetry. The device is looked up again on every sample (by UUID,
//! a cheap call), so no borrowed handle outlives its library. A value NVML does not support on
//! the device (utilisation of a MIG instance, NVLink on a PCIe card) is reported as absent.

use std::time::Instant;

use nvml_wrapper::enum_wrappers::device::{Clock, PcieUtilCounter, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};
use wrk_proto::GpuTelemetry;

/// NVML field ids of the NVLink data counters (KiB since boot), from `nvml.h`.
const NVLINK_DATA_TX: u32 = 138;
const NVLINK_DATA_RX: u32 = 139;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("NVML is not available: {0}")]
    Init(String),
    #[error("NVML does not know the worker's device (tried {tried}): {detail}")]
    UnknownDevice { tried: String, detail: String },
}

/// The NVML identities to try for CUDA device `ordinal`, most specific first. A MIG instance is
/// named by its `MIG-...` UUID in `CUDA_VISIBLE_DEVICES` (the CUDA driver may report the parent
/// GPU's UUID for it), so that entry comes before the UUID the driver reported.
pub fn nvml_lookup_keys(
    ordinal: u32,
    cuda_uuid: &str,
    visible_devices: Option<&str>,
) -> Vec<String> {
    let mut keys = Vec::new();
    if let Some(visible) = visible_devices {
        let entry = visible
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .nth(ordinal as usize);
        if let Some(entry) = entry
            && (entry.starts_with("MIG-") || entry.starts_with("GPU-"))
        {
            keys.push(entry.to_string());
        }
    }
    if !keys.iter().any(|k| k == cuda_uuid) {
        keys.push(cuda_uuid.to_string());
    }
    keys
}

/// The MIG profile in an NVML MIG device name: `NVIDIA A100-SXM4-40GB MIG 1g.5gb` -> `1g.5gb`.
pub fn mig_profile_from_name(name: &str) -> Option<String> {
    let (_, profile) = name.rsplit_once("MIG ")?;
    let profile = profile.trim();
    (!profile.is_empty()).then(|| profile.to_string())
}

/// A PCIe link's capacity per direction: the usable rate of one lane of `generation` (after line
/// coding) times `width` lanes.
pub fn pcie_bytes_per_second(generation: u32, width: u32) -> Option<f64> {
    let per_lane_mb = match generation {
        1 => 250.0,
        2 => 500.0,
        3 => 984.6,
        4 => 1969.2,
        5 => 3938.4,
        6 => 7563.0,
        _ => return None,
    };
    (width > 0).then(|| per_lane_mb * 1e6 * f64::from(width))
}

/// What does not change while the worker runs.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceIdentity {
    pub name: String,
    pub uuid: String,
    pub memory_total: u64,
    /// Set when the device is a MIG instance.
    pub mig_profile: Option<String>,
}

/// An open NVML session on the worker's device.
pub struct Telemetry {
    nvml: Nvml,
    uuid: String,
    identity: DeviceIdentity,
    /// The last NVLink counters (KiB) and when they were read, for throughput.
    nvlink: Option<(Instant, u64, u64)>,
}

impl Telemetry {
    /// Opens NVML and finds the device by the first of `keys` NVML knows.
    pub fn open(keys: &[String]) -> Result<Self, TelemetryError> {
        let nvml = Nvml::init().map_err(|e| TelemetryError::Init(e.to_string()))?;
        let mut last_error = String::from("no identity to look up");
        let mut found = None;
        for key in keys {
            match nvml.device_by_uuid(key.as_str()) {
                Ok(device) => {
                    found = Some(identity(&device, key));
                    break;
                }
                Err(e) => last_error = e.to_string(),
            }
        }
        let identity = found.ok_or_else(|| TelemetryError::UnknownDevice {
            tried: keys.join(", "),
            detail: last_error,
        })?;
        Ok(Telemetry {
            uuid: identity.uuid.clone(),
            nvml,
            identity,
            nvlink: None,
        })
    }

    /// Opens NVML for CUDA device `ordinal` of this process, whose driver-reported UUID is
    /// `cuda_uuid`: by its `CUDA_VISIBLE_DEVICES` entry first (see [`nvml_lookup_keys`]).
    pub fn open_cuda_device(ordinal: u32, cuda_uuid: &str) -> Result<Self, TelemetryError> {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        Self::open(&nvml_lookup_keys(ordinal, cuda_uuid, visible.as_deref()))
    }

    pub fn identity(&self) -> &DeviceIdentity {
        &self.identity
    }

    /// The memory's peak bandwidth in bytes per second: its maximum clock times its bus width,
    /// twice per clock (the figure NVIDIA quotes: 3.35 TB/s for an H100 SXM); `None` where NVML
    /// does not say.
    pub fn peak_memory_bandwidth(&self) -> Option<f64> {
        let device = self.nvml.device_by_uuid(self.uuid.as_str()).ok()?;
        let megahertz = device.max_clock_info(Clock::Memory).ok()?;
        let bus_bits = device.memory_bus_width().ok()?;
        Some(f64::from(megahertz) * 1e6 * 2.0 * f64::from(bus_bits) / 8.0)
    }

    /// One sample of the device's state.
    pub fn sample(&mut self) -> Result<GpuTelemetry, TelemetryError> {
        let device = self.nvml.device_by_uuid(self.uuid.as_str()).map_err(|e| {
            TelemetryError::UnknownDevice {
                tried: self.uuid.clone(),
                detail: e.to_string(),
            }
        })?;
        let memory = device.memory_info().ok();
        let kib_per_s = |counter| {
            device
                .pcie_throughput(counter)
                .ok()
                .map(|kib| f64::from(kib) * 1024.0)
        };
        let (nvlink_tx, nvlink_rx) = nvlink_rates(&device, &mut self.nvlink);
        Ok(GpuTelemetry {
            memory_used_bytes: memory.as_ref().map_or(0, |m| m.used),
            memory_total_bytes: memory
                .as_ref()
                .map_or(self.identity.memory_total, |m| m.total),
            sm_utilization: device
                .utilization_rates()
                .ok()
                .map(|u| f64::from(u.gpu) / 100.0),
            temperature_celsius: device
                .temperature(TemperatureSensor::Gpu)
                .ok()
                .map(f64::from),
            power_watts: device
                .power_usage()
                .ok()
                .map(|milliwatts| f64::from(milliwatts) / 1000.0),
            pcie_tx_bytes_per_second: kib_per_s(PcieUtilCounter::Send),
            pcie_rx_bytes_per_second: kib_per_s(PcieUtilCounter::Receive),
            nvlink_tx_bytes_per_second: nvlink_tx,
            nvlink_rx_bytes_per_second: nvlink_rx,
            device_pool_used_bytes: 0,
            pcie_max_bytes_per_second: match (
                device.current_pcie_link_gen(),
                device.current_pcie_link_width(),
            ) {
                (Ok(generation), Ok(width)) => pcie_bytes_per_second(generation, width),
                _ => None,
            },
        })
    }
}

/// NVLink throughput from the change of NVML's data counters since the last sample; absent
/// where the device has no NVLink (or on the first sample).
fn nvlink_rates(
    device: &Device<'_>,
    last: &mut Option<(Instant, u64, u64)>,
) -> (Option<f64>, Option<f64>) {
    let Ok(values) = device.field_values_for(&[FieldId(NVLINK_DATA_TX), FieldId(NVLINK_DATA_RX)])
    else {
        return (None, None);
    };
    let kib = |i: usize| match values.get(i) {
        Some(Ok(sample)) => match sample.value {
            Ok(SampleValue::U64(v)) => Some(v),
            Ok(SampleValue::U32(v)) => Some(u64::from(v)),
            Ok(SampleValue::I64(v)) => u64::try_from(v).ok(),
            _ => None,
        },
        _ => None,
    };
    let (Some(tx), Some(rx)) = (kib(0), kib(1)) else {
        return (None, None);
    };
    let now = Instant::now();
    let rates = last.map(|(then, tx0, rx0)| {
        let seconds = now.duration_since(then).as_secs_f64().max(1e-3);
        let rate = |a: u64, b: u64| a.saturating_sub(b) as f64 * 1024.0 / seconds;
        (rate(tx, tx0), rate(rx, rx0))
    });
    *last = Some((now, tx, rx));
    match rates {
        Some((tx, rx)) => (Some(tx), Some(rx)),
        None => (None, None),
    }
}

fn identity(device: &Device<'_>, key: &str) -> DeviceIdentity {
    let name = device
        .name()
        .unwrap_or_else(|_| "unknown NVIDIA GPU".into());
    let mig = device.mig_is_mig_device_handle().unwrap_or(false);
    DeviceIdentity {
        mig_profile: if mig {
            mig_profile_from_name(&name)
        } else {
            None
        },
        uuid: device.uuid().unwrap_or_else(|_| key.to_string()),
        memory_total: device.memory_info().map(|m| m.total).unwrap_or(0),
        name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_instances_are_looked_up_by_their_visible_uuid_first() {
        let gpu = "GPU-00112233-4455-6677-8899-aabbccddeeff";
        assert_eq!(nvml_lookup_keys(0, gpu, None), vec![gpu.to_string()]);
        let mig = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
        assert_eq!(
            nvml_lookup_keys(0, gpu, Some(mig)),
            vec![mig.to_string(), gpu.to_string()]
        );
        // The ordinal picks the entry; numeric entries carry no identity.
        assert_eq!(
            nvml_lookup_keys(1, gpu, Some(&format!("{gpu}, {mig}"))),
            vec![mig.to_string(), gpu.to_string()]
        );
        assert_eq!(nvml_lookup_keys(0, gpu, Some("0,1")), vec![gpu.to_string()]);
        assert_eq!(nvml_lookup_keys(0, gpu, Some(gpu)), vec![gpu.to_string()]);
    }

    #[test]
    fn pcie_capacity_follows_generation_and_width() {
        let gen4_x16 = pcie_bytes_per_second(4, 16).unwrap();
        assert!((31.0e9..32.0e9).contains(&gen4_x16), "{gen4_x16}");
        assert_eq!(pcie_bytes_per_second(3, 8), Some(984.6e6 * 8.0));
        assert_eq!(pcie_bytes_per_second(9, 16), None);
        assert_eq!(pcie_bytes_per_second(4, 0), None);
    }

    #[test]
    fn the_mig_profile_comes_from_the_device_name() {
        assert_eq!(
            mig_profile_from_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb").as_deref(),
            Some("1g.5gb")
        );
        assert_eq!(
            mig_profile_from_name("NVIDIA H100 80GB HBM3 MIG 3g.40gb").as_deref(),
            Some("3g.40gb")
        );
        assert_eq!(mig_profile_from_name("NVIDIA H100 80GB HBM3"), None);
    }

    #[test]
    fn without_a_driver_nvml_is_an_error_not_a_panic() {
        match Telemetry::open(&["GPU-00000000-0000-0000-0000-000000000000".into()]) {
            Err(TelemetryError::Init(detail)) => println!("no NVML here: {detail}"),
            // With a driver, the made-up UUID is unknown.
            Err(TelemetryError::UnknownDevice { tried, .. }) => {
                assert!(tried.contains("GPU-0000"))
            }
            Ok(_) => panic!("NVML found a device with a made-up UUID"),
        }
    }
}
