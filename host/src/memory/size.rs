//! Sizing a worker's pool: parsing `--memory-limit` and `--pool-size` (bytes with units such as
//! `512MiB` or `4GiB`, or a fraction such as `0.7`), reading what the machine offers
//! (`/proc/meminfo`, the cgroup's `memory.max`) and checking the three against each other.

use std::path::Path;
use std::str::FromStr;

/// The pool's share of the memory limit when no pool size is given: 30% headroom for the
/// runtime, guests and transient buffers (seed 000: leave 20-40%).
pub const DEFAULT_POOL_FRACTION: f64 = 0.7;

/// A size given on the command line: bytes, or a fraction of the memory limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizeSpec {
    Bytes(u64),
    /// A fraction in (0, 1] of the memory limit.
    Fraction(f64),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SizeError {
    #[error(
        "`{value}` is not a size: give bytes (`1073741824`), bytes with a unit (`512MiB`, `4GiB`, `2GB`) or a fraction (`0.7`): {detail}"
    )]
    Parse { value: String, detail: String },
    #[error("a fraction must be in (0, 1], got {0}")]
    Fraction(f64),
    #[error("a size of zero bytes is not allowed")]
    Zero,
    #[error(
        "the memory limit of {limit} is more than this machine offers ({machine}, from {source_of})"
    )]
    LimitAboveMachine {
        limit: Bytes,
        machine: Bytes,
        source_of: &'static str,
    },
    #[error(
        "the pool of {pool} does not fit in the memory limit of {limit}: give a smaller --pool-size or a larger --memory-limit"
    )]
    PoolAboveLimit { pool: Bytes, limit: Bytes },
    #[error("the memory limit cannot be a fraction of itself: give it in bytes (`8GiB`)")]
    FractionalLimit,
    #[error("cannot tell how much memory this machine has: {0}")]
    Machine(String),
}

/// A byte count printed in binary units (`1.5 GiB`) with the exact figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} bytes)",
            bytesize::ByteSize::b(self.0).display().iec(),
            self.0
        )
    }
}

impl FromStr for SizeSpec {
    type Err = SizeError;

    fn from_str(value: &str) -> Result<Self, SizeError> {
        let text = value.trim();
        let parse_err = |detail: String| SizeError::Parse {
            value: value.to_string(),
            detail,
        };
        // A bare decimal number is a fraction; a bare integer, bytes.
        if text.contains('.') && text.chars().all(|c| c.is_ascii_digit() || c == '.') {
            let fraction: f64 = text.parse().map_err(|e| parse_err(format!("{e}")))?;
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(SizeError::Fraction(fraction));
            }
            return Ok(SizeSpec::Fraction(fraction));
        }
        let bytes = bytesize::ByteSize::from_str(text).map_err(parse_err)?.0;
        if bytes == 0 {
            return Err(SizeError::Zero);
        }
        Ok(SizeSpec::Bytes(bytes))
    }
}

/// What the machine (or the container) offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineMemory {
    /// `MemTotal` of `/proc/meminfo`.
    pub total: u64,
    /// The cgroup's memory limit (`memory.max`, or cgroup v1's `memory.limit_in_bytes`), when
    /// one is set.
    pub cgroup_limit: Option<u64>,
}

impl MachineMemory {
    /// Reads `/proc/meminfo` and the cgroup limit of this process.
    pub fn detect() -> Result<Self, SizeError> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")
            .map_err(|e| SizeError::Machine(format!("reading /proc/meminfo: {e}")))?;
        let total = parse_meminfo_total(&meminfo).ok_or_else(|| {
            SizeError::Machine("/proc/meminfo has no readable MemTotal line".into())
        })?;
        let cgroup_limit = [
            "/sys/fs/cgroup/memory.max",
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        ]
        .iter()
        .find_map(|path| read_cgroup_limit(Path::new(path)));
        Ok(MachineMemory {
            total,
            cgroup_limit,
        })
    }

    /// The most this process may use, and where that figure comes from.
    pub fn available(&self) -> (u64, &'static str) {
        match self.cgroup_limit {
            Some(limit) if limit < self.total => (limit, "the cgroup's memory.max"),
            _ => (self.total, "MemTotal in /proc/meminfo"),
        }
    }
}

fn parse_meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => Some(value * 1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// A cgroup limit file: a byte count, or `max` (no limit). cgroup v1 reports "no limit" as a
/// huge number, which `available` ignores since it exceeds `MemTotal`.
fn read_cgroup_limit(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.trim().parse().ok()
}

/// The checked memory settings of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySettings {
    /// What the worker process may use in all.
    pub limit: u64,
    /// The pool inside it.
    pub pool: u64,
}

/// Checks `--memory-limit` and `--pool-size` against each other and against the machine.
///
/// The limit defaults to what the machine (or its cgroup) offers; the pool to
/// [`DEFAULT_POOL_FRACTION`] of the limit. A pool fraction is a fraction of the limit.
pub fn resolve(
    limit: Option<SizeSpec>,
    pool: Option<SizeSpec>,
    machine: MachineMemory,
) -> Result<MemorySettings, SizeError> {
    let (available, source_of) = machine.available();
    let limit = match limit {
        None => available,
        Some(SizeSpec::Fraction(_)) => return Err(SizeError::FractionalLimit),
        Some(SizeSpec::Bytes(limit)) if limit > available => {
            return Err(SizeError::LimitAboveMachine {
                limit: Bytes(limit),
                machine: Bytes(available),
                source_of,
            });
        }
        Some(SizeSpec::Bytes(limit)) => limit,
    };
    let pool = match pool.unwrap_or(SizeSpec::Fraction(DEFAULT_POOL_FRACTION)) {
        SizeSpec::Fraction(fraction) => ((limit as f64) * fraction) as u64,
        SizeSpec::Bytes(pool) if pool > limit => {
            return Err(SizeError::PoolAboveLimit {
                pool: Bytes(pool),
                limit: Bytes(limit),
            });
        }
        SizeSpec::Bytes(pool) => pool,
    };
    Ok(MemorySettings {
        limit,
        pool: pool.max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn machine(total: u64, cgroup_limit: Option<u64>) -> MachineMemory {
        MachineMemory {
            total,
            cgroup_limit,
        }
    }

    #[test]
    fn sizes_parse_with_units_and_fractions() {
        assert_eq!("512MiB".parse(), Ok(SizeSpec::Bytes(512 << 20)));
        assert_eq!("4GiB".parse(), Ok(SizeSpec::Bytes(4 * GIB)));
        assert_eq!("4 GiB".parse(), Ok(SizeSpec::Bytes(4 * GIB)));
        assert_eq!("2GB".parse(), Ok(SizeSpec::Bytes(2_000_000_000)));
        assert_eq!("1073741824".parse(), Ok(SizeSpec::Bytes(GIB)));
        assert_eq!("0.7".parse(), Ok(SizeSpec::Fraction(0.7)));
        assert_eq!("1.0".parse(), Ok(SizeSpec::Fraction(1.0)));
        assert_eq!("1.5".parse::<SizeSpec>(), Err(SizeError::Fraction(1.5)));
        assert_eq!("0".parse::<SizeSpec>(), Err(SizeError::Zero));
        let bad = "lots".parse::<SizeSpec>().unwrap_err().to_string();
        assert!(bad.contains("`lots` is not a size"), "{bad}");
        let unit = "3 parsecs".parse::<SizeSpec>().unwrap_err().to_string();
        assert!(unit.contains("512MiB"), "{unit}");
    }

    #[test]
    fn defaults_leave_headroom_within_the_machine() {
        let settings = resolve(None, None, machine(16 * GIB, None)).unwrap();
        assert_eq!(settings.limit, 16 * GIB);
        assert_eq!(settings.pool, (16.0 * GIB as f64 * 0.7) as u64);
        // A cgroup limit below the machine's memory is what the process may use.
        let settings = resolve(None, None, machine(16 * GIB, Some(4 * GIB))).unwrap();
        assert_eq!(settings.limit, 4 * GIB);
        // cgroup v1's "no limit" is a huge number: the machine's memory counts.
        let settings = resolve(None, None, machine(16 * GIB, Some(u64::MAX / 2))).unwrap();
        assert_eq!(settings.limit, 16 * GIB);
    }

    #[test]
    fn a_pool_fraction_is_a_fraction_of_the_limit() {
        let settings = resolve(
            Some(SizeSpec::Bytes(8 * GIB)),
            Some(SizeSpec::Fraction(0.5)),
            machine(16 * GIB, None),
        )
        .unwrap();
        assert_eq!(
            settings,
            MemorySettings {
                limit: 8 * GIB,
                pool: 4 * GIB
            }
        );
    }

    #[test]
    fn inconsistent_settings_are_refused_with_the_sizes() {
        let err = resolve(
            Some(SizeSpec::Bytes(4 * GIB)),
            Some(SizeSpec::Bytes(6 * GIB)),
            machine(16 * GIB, None),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("pool of 6.0 GiB"), "{err}");
        assert!(err.contains("memory limit of 4.0 GiB"), "{err}");
        let err = resolve(
            Some(SizeSpec::Bytes(32 * GIB)),
            None,
            machine(64 * GIB, Some(16 * GIB)),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("32.0 GiB"), "{err}");
        assert!(err.contains("16.0 GiB"), "{err}");
        assert!(err.contains("memory.max"), "{err}");
        assert_eq!(
            resolve(Some(SizeSpec::Fraction(0.5)), None, machine(GIB, None)),
            Err(SizeError::FractionalLimit)
        );
        // Without a limit, the pool is checked against the machine.
        assert!(resolve(None, Some(SizeSpec::Bytes(2 * GIB)), machine(GIB, None)).is_err());
    }

    #[test]
    fn meminfo_and_cgroup_files_parse() {
        let meminfo = "MemTotal:       24576000 kB\nMemFree:         1000 kB\n";
        assert_eq!(parse_meminfo_total(meminfo), Some(24_576_000 * 1024));
        assert_eq!(parse_meminfo_total("MemFree: 1 kB\n"), None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory.max");
        std::fs::write(&path, "max\n").unwrap();
        assert_eq!(read_cgroup_limit(&path), None);
        std::fs::write(&path, "4294967296\n").unwrap();
        assert_eq!(read_cgroup_limit(&path), Some(4 * GIB));
        // This machine has memory.
        assert!(MachineMemory::detect().unwrap().total > 0);
    }
}
