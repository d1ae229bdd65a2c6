//! Filter compaction of 8-byte values (`f64`, `i64`, timestamps) with AVX2: the kept values of
//! each group of four are moved to the front of a vector register by one permutation looked
//! up from the group's four mask bits, and stored at once, so a kept value costs no branch.
//!
//! A filter that keeps a third of the rows at random spent 40% of a scan walking the mask's set
//! bits one at a time; this loop does a group of four in a handful of instructions.

use std::mem::MaybeUninit;

use arrow::buffer::BooleanBuffer;

/// How many values past the kept ones [`compress_8byte`] may write: room the output must have.
pub const SLACK: usize = 4;

/// Copies the values of `values` whose bit in `mask` is set to the front of `out`, in order,
/// and returns how many it copied; None when the CPU has no AVX2 or `T` is not 8 bytes (the
/// caller compacts another way). `out` must have room for the kept values plus [`SLACK`].
pub fn compress_8byte<T: Copy>(
    values: &[T],
    mask: &BooleanBuffer,
    out: &mut [MaybeUninit<T>],
) -> Option<usize> {
    if size_of::<T>() != 8 || mask.len() != values.len() {
        return None;
    }
    let kept = mask.count_set_bits();
    assert!(
        out.len() >= kept + SLACK,
        "the output has no room for the slack"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above); `T` is 8 bytes of plain data, as
        // `u64`; `out` holds `kept + SLACK` values, checked above.
        let written = unsafe {
            compress_avx2(
                std::slice::from_raw_parts(values.as_ptr().cast::<u64>(), values.len()),
                mask,
                out.as_mut_ptr().cast::<u64>(),
            )
        };
        debug_assert_eq!(written, kept);
        return Some(written);
    }
    None
}

/// For each 4-bit mask, the 32-bit lanes that gather its kept 64-bit values to the front.
#[cfg(target_arch = "x86_64")]
const PERMUTATIONS: [[i32; 8]; 16] = {
    let mut table = [[0i32; 8]; 16];
    let mut mask = 0;
    while mask < 16 {
        let mut lane: i32 = 0;
        let mut to = 0;
        while lane < 4 {
            if mask & (1 << lane) != 0 {
                table[mask][2 * to] = 2 * lane;
                table[mask][2 * to + 1] = 2 * lane + 1;
                to += 1;
            }
            lane += 1;
        }
        mask += 1;
    }
    table
};

/// # Safety
/// The CPU must have AVX2, `mask` must be as long as `values`, and `out` must have room for
/// the kept values plus [`SLACK`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn compress_avx2(values: &[u64], mask: &BooleanBuffer, out: *mut u64) -> usize {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_permutevar8x32_epi32, _mm256_storeu_si256,
    };
    let chunks = mask.bit_chunks();
    let mut written = 0usize;
    for (chunk, word) in chunks.iter().enumerate() {
        let base = chunk * 64;
        match word {
            0 => {}
            u64::MAX => {
                // SAFETY: the 64 values are in `values`; `out` has room for every kept one.
                unsafe {
                    std::ptr::copy_nonoverlapping(values.as_ptr().add(base), out.add(written), 64)
                };
                written += 64;
            }
            _ => {
                for group in 0..16 {
                    let bits = ((word >> (4 * group)) & 0xF) as usize;
                    // SAFETY: the four values from `base + 4 * group` are in `values` (a whole
                    // chunk of 64); the store writes four values at `written`, at most
                    // `SLACK` past the kept ones, which `out` has room for.
                    unsafe {
                        let from = values.as_ptr().add(base + 4 * group).cast::<__m256i>();
                        let lanes =
                            _mm256_loadu_si256(PERMUTATIONS[bits].as_ptr().cast::<__m256i>());
                        let packed = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(from), lanes);
                        _mm256_storeu_si256(out.add(written).cast::<__m256i>(), packed);
                    }
                    written += bits.count_ones() as usize;
                }
            }
        }
    }
    let tail = chunks.remainder_bits();
    let base = chunks.chunk_len() * 64;
    for i in 0..chunks.remainder_len() {
        if tail & (1 << i) != 0 {
            // SAFETY: `base + i` is below `values.len()`; `written` is below the kept count.
            unsafe { out.add(written).write(values[base + i]) };
            written += 1;
        }
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compress<T: Copy>(values: &[T], mask: &BooleanBuffer) -> Option<Vec<T>> {
        let kept = mask.count_set_bits();
        let mut out = Vec::with_capacity(kept + SLACK);
        let written = compress_8byte(values, mask, out.spare_capacity_mut())?;
        assert_eq!(written, kept);
        // SAFETY: `compress_8byte` wrote the first `written` values.
        unsafe { out.set_len(written) };
        Some(out)
    }

    fn expected<T: Copy>(values: &[T], mask: &BooleanBuffer) -> Vec<T> {
        mask.set_indices().map(|i| values[i]).collect()
    }

    #[test]
    fn kept_values_come_out_in_order_for_every_density_and_offset() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            println!("skipped: this CPU has no AVX2");
            return;
        }
        let values: Vec<f64> = (0..1_000).map(|i| f64::from(i) * 1.5 - 7.0).collect();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for percent in [0u64, 1, 31, 50, 90, 100] {
            let bits: Vec<bool> = (0..1_000)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state % 100 < percent
                })
                .collect();
            let mask = BooleanBuffer::from(bits);
            assert_eq!(compress(&values, &mask).unwrap(), expected(&values, &mask));
            // A mask that starts mid-byte, over values not a whole number of chunks.
            let (mask, values) = (mask.slice(3, 900), &values[3..903]);
            assert_eq!(compress(values, &mask).unwrap(), expected(values, &mask));
        }
        let ints: Vec<i64> = (0..130).collect();
        let mask = BooleanBuffer::from_iter((0..130).map(|i| i % 3 == 0));
        assert_eq!(compress(&ints, &mask).unwrap(), expected(&ints, &mask));
    }

    #[test]
    fn other_widths_are_left_to_the_caller() {
        let mask = BooleanBuffer::from(vec![true, false]);
        assert_eq!(compress(&[1i32, 2], &mask), None);
        assert_eq!(compress(&[1u8, 2], &mask), None);
    }
}
