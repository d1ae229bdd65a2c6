//! Launching kernels and the building blocks every device operator shares: prefix sums, stream
//! compaction (the selected rows of a 0/1 flag column), gathers of columns and tables, and the
//! stable LSD radix sort of 64-bit words.
//!
//! Sizes the host needs to allocate the next buffer (a scan's total, the bits a sort must look
//! at) are read back as small scalars; those reads are control traffic, not table data, and are
//! not counted as transfers.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::GpuRuntime;
use super::backend::Backend;
use super::kernels::{Kernel, KernelError};
use super::pool::{DeviceBuffer, PoolError};
use super::table::{
    DeviceColumn, DeviceTable, TableError, address, to_host, to_host_at, value_width,
};

/// "No row": gathers as a null (the unmatched side of a left join).
pub const NONE: u32 = u32::MAX;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Table(#[from] TableError),
    #[error("launching `{kernel}` failed: {detail}")]
    Launch { kernel: String, detail: String },
    #[error("{rows} rows exceed the device operators' 32-bit row indices")]
    TooManyRows { rows: usize },
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    /// A device buffer's address.
    Buf(&'a DeviceBuffer),
    /// A buffer's address plus a byte offset.
    At(&'a DeviceBuffer, u64),
    /// An optional buffer: null when absent.
    Opt(Option<&'a DeviceBuffer>),
    I64(i64),
    U64(u64),
    U32(u32),
    I32(i32),
    F64(f64),
    U8(u8),
}

/// Threads per block of the row kernels (grid-stride loops).
pub(crate) const BLOCK: u32 = 256;
/// Threads per block of the scan (its blocks scan exactly this many values).
const SCAN_BLOCK: u32 = 1024;

/// A grid covering `n` rows (grid-stride loops cover the rest).
pub fn rows_config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The most groups the accumulating kernels keep in shared memory (`WRK_SHARED_GROUPS` in
/// `fixed.cu`): up to this many, each warp of a block accumulates its rows privately and the
/// block adds its totals into the global accumulators once.
const SHARED_GROUPS: usize = 256;
/// The most blocks of an accumulating launch over at most [`SHARED_GROUPS`] groups: several
/// per multiprocessor of the largest GPUs, and few enough that the blocks' final adds (one per
/// group per block) stay cheap.
const ACCUMULATE_BLOCKS: u32 = 1024;

/// A grid for an accumulating kernel over `n` rows into `groups` accumulators.
fn accumulate_config(n: usize, groups: usize) -> LaunchConfig {
    let mut config = rows_config(n);
    if groups <= SHARED_GROUPS {
        config.grid_dim.0 = config.grid_dim.0.min(ACCUMULATE_BLOCKS);
    }
    config
}

/// Checks that `rows` fit the kernels' `u32` row indices.
pub fn check_rows(rows: usize) -> Result<u32, ExecError> {
    u32::try_from(rows)
        .ok()
        .filter(|r| *r != NONE)
        .ok_or(ExecError::TooManyRows { rows })
}

/// Launches `kernel` with `args`.
///
/// # Safety contract
/// The arguments must match the kernel's parameter list in `fixed.cu` (or the generated
/// signature of a fused kernel) in number, order and type, and every buffer must be large enough
/// for the rows the kernel touches; each call site is written against that signature.
pub fn launch(
    runtime: &GpuRuntime,
    kernel: &Kernel,
    name: &str,
    config: LaunchConfig,
    args: &[Arg<'_>],
) -> Result<(), ExecError> {
    // Every argument as the bytes the kernel receives: addresses and scalars, kept alive here.
    #[derive(Clone, Copy)]
    enum Value {
        U64(u64),
        I64(i64),
        U32(u32),
        I32(i32),
        F64(f64),
        U8(u8),
    }
    let mut values: Vec<Value> = args
        .iter()
        .map(|a| match *a {
            Arg::Buf(b) => Value::U64(address(runtime, b, 0)),
            Arg::At(b, offset) => Value::U64(address(runtime, b, offset)),
            Arg::Opt(b) => Value::U64(b.map_or(0, |b| address(runtime, b, 0))),
            Arg::I64(v) => Value::I64(v),
            Arg::U64(v) => Value::U64(v),
            Arg::U32(v) => Value::U32(v),
            Arg::I32(v) => Value::I32(v),
            Arg::F64(v) => Value::F64(v),
            Arg::U8(v) => Value::U8(v),
        })
        .collect();
    let failed = |detail: String| ExecError::Launch {
        kernel: name.to_string(),
        detail,
    };
    match (&*runtime.backend, kernel) {
        (Backend::Cuda { stream, .. }, Kernel::Cuda(function)) => {
            let mut builder = stream.launch_builder(function);
            for value in &values {
                match value {
                    Value::U64(v) => builder.arg(v),
                    Value::I64(v) => builder.arg(v),
                    Value::U32(v) => builder.arg(v),
                    Value::I32(v) => builder.arg(v),
                    Value::F64(v) => builder.arg(v),
                    Value::U8(v) => builder.arg(v),
                };
            }
            // SAFETY: see the contract above; the kernel reads only the buffers passed, which
            // outlive the launch because every caller synchronises (or keeps them) before
            // dropping them.
            unsafe { builder.launch(config) }.map_err(|e| failed(e.to_string()))?;
        }
        (Backend::Emulated, Kernel::Emulated(kernel)) => {
            let mut pointers: Vec<*mut c_void> = values
                .iter_mut()
                .map(|value| match value {
                    Value::U64(v) => (v as *mut u64).cast(),
                    Value::I64(v) => (v as *mut i64).cast(),
                    Value::U32(v) => (v as *mut u32).cast(),
                    Value::I32(v) => (v as *mut i32).cast(),
                    Value::F64(v) => (v as *mut f64).cast(),
                    Value::U8(v) => (v as *mut u8).cast(),
                })
                .collect();
            // SAFETY: as for a CUDA launch; the emulator returns after the kernel has finished.
            unsafe { kernel.launch(config.grid_dim.0, config.block_dim.0, &mut pointers) }
                .map_err(failed)?;
        }
        _ => return Err(failed("the kernel was compiled for another backend".into())),
    }
    Ok(())
}

/// Launches the fixed kernel `name` over `n` rows.
pub fn run(runtime: &GpuRuntime, name: &str, n: usize, args: &[Arg<'_>]) -> Result<(), ExecError> {
    let kernel = runtime.kernels.fixed(name)?;
    launch(runtime, &kernel, name, rows_config(n), args)
}

/// Runs the accumulating kernel `name` (one built on `WRK_ACCUMULATE`) over `n` rows into
/// `groups` accumulators.
pub fn run_accumulate(
    runtime: &GpuRuntime,
    name: &str,
    n: usize,
    groups: usize,
    args: &[Arg<'_>],
) -> Result<(), ExecError> {
    let kernel = runtime.kernels.fixed(name)?;
    launch(runtime, &kernel, name, accumulate_config(n, groups), args)
}

/// A pool buffer of `count` elements of `width` bytes.
pub fn alloc(runtime: &GpuRuntime, count: usize, width: usize) -> Result<DeviceBuffer, ExecError> {
    Ok(runtime.pool.alloc((count * width) as u64)?)
}

/// `count` `u32`s set to `value`.
pub fn filled_u32(
    runtime: &GpuRuntime,
    count: usize,
    value: u32,
) -> Result<DeviceBuffer, ExecError> {
    let buffer = alloc(runtime, count, 4)?;
    run(
        runtime,
        "wrk_fill_u32",
        count,
        &[Arg::Buf(&buffer), Arg::U32(value), Arg::I64(count as i64)],
    )?;
    Ok(buffer)
}

/// `count` `u64`s set to `value`.
pub fn filled_u64(
    runtime: &GpuRuntime,
    count: usize,
    value: u64,
) -> Result<DeviceBuffer, ExecError> {
    let buffer = alloc(runtime, count, 8)?;
    run(
        runtime,
        "wrk_fill_u64",
        count,
        &[Arg::Buf(&buffer), Arg::U64(value), Arg::I64(count as i64)],
    )?;
    Ok(buffer)
}

/// `count` bytes set to `value`.
pub fn filled_u8(runtime: &GpuRuntime, count: usize, value: u8) -> Result<DeviceBuffer, ExecError> {
    let buffer = alloc(runtime, count, 1)?;
    run(
        runtime,
        "wrk_fill_u8",
        count,
        &[Arg::Buf(&buffer), Arg::U8(value), Arg::I64(count as i64)],
    )?;
    Ok(buffer)
}

/// `start, start + 1, ..., start + count - 1`.
pub fn iota(runtime: &GpuRuntime, start: u32, count: usize) -> Result<DeviceBuffer, ExecError> {
    let buffer = alloc(runtime, count, 4)?;
    run(
        runtime,
        "wrk_iota_u32",
        count,
        &[Arg::Buf(&buffer), Arg::U32(start), Arg::I64(count as i64)],
    )?;
    Ok(buffer)
}

/// Element `index` of a buffer of 4-byte values, as its bytes: one 4-byte copy.
fn read_4(runtime: &GpuRuntime, buffer: &DeviceBuffer, index: usize) -> Result<[u8; 4], ExecError> {
    let bytes = to_host_at(runtime, buffer, index * 4, 4)?;
    Ok([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Element `index` of a `u32` buffer.
pub fn read_u32(
    runtime: &GpuRuntime,
    buffer: &DeviceBuffer,
    index: usize,
) -> Result<u32, ExecError> {
    read_4(runtime, buffer, index).map(u32::from_le_bytes)
}

/// Element `index` of an `i32` buffer (a string column's offsets).
pub fn read_i32(
    runtime: &GpuRuntime,
    buffer: &DeviceBuffer,
    index: usize,
) -> Result<i32, ExecError> {
    read_4(runtime, buffer, index).map(i32::from_le_bytes)
}

/// The exclusive prefix sum of `n` `u32` values, and their total.
pub fn exclusive_scan(
    runtime: &GpuRuntime,
    values: &DeviceBuffer,
    n: usize,
) -> Result<(DeviceBuffer, u32), ExecError> {
    let out = alloc(runtime, n, 4)?;
    if n == 0 {
        return Ok((out, 0));
    }
    let blocks = n.div_ceil(SCAN_BLOCK as usize);
    let sums = alloc(runtime, blocks, 4)?;
    let config = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (SCAN_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let scan = runtime.kernels.fixed("wrk_scan_blocks")?;
    launch(
        runtime,
        &scan,
        "wrk_scan_blocks",
        config,
        &[
            Arg::Buf(values),
            Arg::Buf(&out),
            Arg::Buf(&sums),
            Arg::I64(n as i64),
        ],
    )?;
    if blocks > 1 {
        let (offsets, _) = exclusive_scan(runtime, &sums, blocks)?;
        let add = runtime.kernels.fixed("wrk_scan_add")?;
        launch(
            runtime,
            &add,
            "wrk_scan_add",
            config,
            &[Arg::Buf(&out), Arg::Buf(&offsets), Arg::I64(n as i64)],
        )?;
    }
    let total = read_u32(runtime, &out, n - 1)? + read_u32(runtime, values, n - 1)?;
    Ok((out, total))
}

/// The indices of the rows whose flag is 1, in order, and how many there are.
pub fn selected_rows(
    runtime: &GpuRuntime,
    flags: &DeviceBuffer,
    n: usize,
) -> Result<(DeviceBuffer, usize), ExecError> {
    let (positions, total) = exclusive_scan(runtime, flags, n)?;
    let indices = alloc(runtime, total as usize, 4)?;
    run(
        runtime,
        "wrk_selected_rows",
        n,
        &[
            Arg::Buf(flags),
            Arg::Buf(&positions),
            Arg::Buf(&indices),
            Arg::I64(n as i64),
        ],
    )?;
    Ok((indices, total as usize))
}

/// Rows `indices[0..m]` of `column` (a `NONE` index gives a null).
pub fn gather_column(
    runtime: &GpuRuntime,
    column: &DeviceColumn,
    indices: &DeviceBuffer,
    m: usize,
    may_be_none: bool,
) -> Result<DeviceColumn, ExecError> {
    let rows = Arg::I64(m as i64);
    let validity = if column.validity.is_some() || may_be_none {
        let out = alloc(runtime, m, 1)?;
        run(
            runtime,
            "wrk_gather_valid",
            m,
            &[
                Arg::Opt(column.validity.as_ref()),
                Arg::Buf(indices),
                Arg::Buf(&out),
                rows,
            ],
        )?;
        Some(out)
    } else {
        None
    };
    let (values, offsets) = match &column.data_type {
        arrow::datatypes::DataType::Null => (alloc(runtime, 0, 1)?, None),
        arrow::datatypes::DataType::Utf8 => {
            let src_offsets = column.offsets.as_ref().ok_or_else(|| TableError::Rebuild {
                column: "a string column".into(),
                detail: "no offsets".into(),
            })?;
            let lengths = alloc(runtime, m, 4)?;
            run(
                runtime,
                "wrk_gather_str_lengths",
                m,
                &[
                    Arg::Buf(src_offsets),
                    Arg::Buf(indices),
                    Arg::Buf(&lengths),
                    rows,
                ],
            )?;
            let (positions, total) = exclusive_scan(runtime, &lengths, m)?;
            let offsets = alloc(runtime, m + 1, 4)?;
            run(
                runtime,
                "wrk_offsets_to_i32",
                m + 1,
                &[
                    Arg::Buf(&positions),
                    Arg::U32(total),
                    Arg::Buf(&offsets),
                    rows,
                ],
            )?;
            let bytes = alloc(runtime, total as usize, 1)?;
            run(
                runtime,
                "wrk_gather_str_bytes",
                m,
                &[
                    Arg::Buf(src_offsets),
                    Arg::Buf(&column.values),
                    Arg::Buf(indices),
                    Arg::Buf(&positions),
                    Arg::Buf(&bytes),
                    rows,
                ],
            )?;
            (bytes, Some(offsets))
        }
        other => {
            let width = value_width(other).ok_or_else(|| TableError::Unsupported {
                column: "gathered".into(),
                data_type: other.clone(),
            })?;
            (
                gather_values(runtime, &column.values, width, indices, m)?,
                None,
            )
        }
    };
    Ok(DeviceColumn {
        data_type: column.data_type.clone(),
        len: m,
        values,
        offsets,
        validity,
    })
}

/// `values[indices[i]]` for `i` in `0..m`, each value `width` bytes (1, 2, 4 or 8).
pub fn gather_values(
    runtime: &GpuRuntime,
    values: &DeviceBuffer,
    width: usize,
    indices: &DeviceBuffer,
    m: usize,
) -> Result<DeviceBuffer, ExecError> {
    let out = alloc(runtime, m, width)?;
    let kernel = match width {
        1 => "wrk_gather_1",
        2 => "wrk_gather_2",
        4 => "wrk_gather_4",
        _ => "wrk_gather_8",
    };
    run(
        runtime,
        kernel,
        m,
        &[
            Arg::Buf(values),
            Arg::Buf(indices),
            Arg::Buf(&out),
            Arg::I64(m as i64),
        ],
    )?;
    Ok(out)
}

/// Rows `indices[0..m]` of every column of `table`.
pub fn gather_table(
    runtime: &GpuRuntime,
    table: &DeviceTable,
    indices: &DeviceBuffer,
    m: usize,
) -> Result<DeviceTable, ExecError> {
    let columns = table
        .columns
        .iter()
        .map(|c| gather_column(runtime, c, indices, m, false).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(DeviceTable {
        schema: table.schema.clone(),
        columns,
        rows: m,
    })
}

/// Keys per block of the radix sort's kernels (`WRK_RADIX_TILE` in `fixed.cu`), which run
/// [`RADIX_THREADS`] threads per block.
const RADIX_TILE: usize = 2048;
const RADIX_THREADS: u32 = 256;
/// Digits of the radix sort (`WRK_RADIX_DIGITS`): 4 bits per pass.
const RADIX_DIGITS: usize = 16;

/// Stably reorders `perm` (`n` row indices) by the words they point at, in ascending unsigned
/// order: the words are gathered in `perm`'s order, then (word, row) pairs are sorted 4 bits
/// per pass, over the digits where the words differ.
pub fn radix_sort(
    runtime: &GpuRuntime,
    words: &DeviceBuffer,
    mut perm: DeviceBuffer,
    n: usize,
) -> Result<DeviceBuffer, ExecError> {
    if n < 2 {
        return Ok(perm);
    }
    let init = [0u64.to_le_bytes(), u64::MAX.to_le_bytes()].concat();
    let or_and = super::table::to_device(runtime, &init)?;
    run_accumulate(
        runtime,
        "wrk_bits_in_use",
        n,
        1,
        &[Arg::Buf(words), Arg::Buf(&or_and), Arg::I64(n as i64)],
    )?;
    let bytes = to_host(runtime, &or_and, 16)?;
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    let varying = word(0) ^ word(1);
    let shifts: Vec<u32> = (0..64u32)
        .step_by(4)
        .filter(|shift| (varying >> shift) & 0xf != 0)
        .collect();
    if shifts.is_empty() {
        return Ok(perm);
    }
    let mut keys = gather_values(runtime, words, 8, &perm, n)?;
    let tiles = n.div_ceil(RADIX_TILE);
    let config = LaunchConfig {
        grid_dim: (tiles as u32, 1, 1),
        block_dim: (RADIX_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let count_kernel = runtime.kernels.fixed("wrk_radix_count")?;
    let scatter_kernel = runtime.kernels.fixed("wrk_radix_scatter")?;
    let counts = alloc(runtime, tiles * RADIX_DIGITS, 4)?;
    let mut keys_out = alloc(runtime, n, 8)?;
    let mut perm_out = alloc(runtime, n, 4)?;
    for shift in shifts {
        launch(
            runtime,
            &count_kernel,
            "wrk_radix_count",
            config,
            &[
                Arg::Buf(&keys),
                Arg::U32(shift),
                Arg::Buf(&counts),
                Arg::I64(n as i64),
            ],
        )?;
        let (offsets, _) = exclusive_scan(runtime, &counts, tiles * RADIX_DIGITS)?;
        launch(
            runtime,
            &scatter_kernel,
            "wrk_radix_scatter",
            config,
            &[
                Arg::Buf(&keys),
                Arg::Buf(&perm),
                Arg::U32(shift),
                Arg::Buf(&offsets),
                Arg::Buf(&keys_out),
                Arg::Buf(&perm_out),
                Arg::I64(n as i64),
            ],
        )?;
        std::mem::swap(&mut keys, &mut keys_out);
        std::mem::swap(&mut perm, &mut perm_out);
    }
    Ok(perm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::table::to_device;

    fn u32s(bytes: &[u8]) -> Vec<u32> {
        bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[test]
    fn the_scan_and_compaction_match_the_host_at_every_depth() {
        let Some(runtime) = crate::gpu::test_device("the_scan_matches_the_host") else {
            return;
        };
        // One block, a partial second block, two levels, and three levels (over 1024 blocks).
        for n in [
            1usize,
            31,
            1024,
            1025,
            70_000,
            SCAN_BLOCK as usize * 1024 + 5,
        ] {
            let flags: Vec<u32> = (0..n).map(|i| u32::from(i % 3 != 1)).collect();
            let bytes: Vec<u8> = flags.iter().flat_map(|v| v.to_le_bytes()).collect();
            let device = to_device(&runtime, &bytes).unwrap();
            let (positions, total) = exclusive_scan(&runtime, &device, n).unwrap();
            let expected: Vec<u32> = flags
                .iter()
                .scan(0u32, |sum, v| {
                    let before = *sum;
                    *sum += v;
                    Some(before)
                })
                .collect();
            let got = u32s(&to_host(&runtime, &positions, n * 4).unwrap());
            assert_eq!(got, expected, "{n} values");
            assert_eq!(total, flags.iter().sum::<u32>(), "{n} values");
            let (indices, selected) = selected_rows(&runtime, &device, n).unwrap();
            let got = u32s(&to_host(&runtime, &indices, selected * 4).unwrap());
            let expected: Vec<u32> = (0..n as u32).filter(|i| i % 3 != 1).collect();
            assert_eq!(got, expected, "{n} values");
        }
    }

    /// The launch shapes here are the ones the kernels were written for.
    #[test]
    fn launch_constants_match_the_kernels_defines() {
        let source = super::super::kernels::FIXED_SOURCE;
        for define in [
            format!("#define WRK_SHARED_GROUPS {SHARED_GROUPS}\n"),
            format!("#define WRK_SHARED_WARPS {}\n", BLOCK / 32),
            format!("#define WRK_RADIX_THREADS {RADIX_THREADS}\n"),
            format!(
                "#define WRK_RADIX_ITEMS {}\n",
                RADIX_TILE / RADIX_THREADS as usize
            ),
            format!("#define WRK_RADIX_DIGITS {RADIX_DIGITS}\n"),
        ] {
            assert!(
                source.contains(&define),
                "fixed.cu lacks `{}`",
                define.trim()
            );
        }
    }

    #[test]
    fn the_radix_sort_is_stable_and_matches_the_host() {
        let Some(runtime) = crate::gpu::test_device("the_radix_sort_matches_the_host") else {
            return;
        };
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        // Within a tile, a tile and one, several tiles; words over all 64 bits, words that
        // differ only in a few middle bits (digits skipped), and many equal words (stability).
        for n in [
            2usize,
            7,
            RADIX_TILE,
            RADIX_TILE + 1,
            3 * RADIX_TILE + 77,
            40_000,
        ] {
            for kind in 0..3 {
                let words: Vec<u64> = (0..n)
                    .map(|_| match kind {
                        0 => next(),
                        1 => 0xabc0_0000_0000_0007 | ((next() % 50) << 20),
                        _ => next() % 5,
                    })
                    .collect();
                // The rows start in an order of their own (reversed), as a later key's pass.
                let perm: Vec<u32> = (0..n as u32).rev().collect();
                let to_bytes = |v: &[u8]| to_device(&runtime, v).unwrap();
                let device_words = to_bytes(
                    &words
                        .iter()
                        .flat_map(|w| w.to_le_bytes())
                        .collect::<Vec<_>>(),
                );
                let device_perm = to_bytes(
                    &perm
                        .iter()
                        .flat_map(|r| r.to_le_bytes())
                        .collect::<Vec<_>>(),
                );
                let sorted = radix_sort(&runtime, &device_words, device_perm, n).unwrap();
                let got = u32s(&to_host(&runtime, &sorted, n * 4).unwrap());
                let mut expected = perm.clone();
                expected.sort_by_key(|&row| words[row as usize]);
                assert_eq!(got, expected, "{n} words of kind {kind}");
            }
        }
    }
}
