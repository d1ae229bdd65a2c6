//! Helpers shared by the UCX tests: payload patterns and an order-sensitive checksum.

#![allow(dead_code)] // each test binary uses a subset

use bytes::Bytes;

/// A payload of `len` bytes that differs for every `index` and every position.
pub fn pattern(index: u64, len: usize) -> Bytes {
    let mut out = Vec::with_capacity(len);
    let mut x = index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    while out.len() + 8 <= len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    let tail = len - out.len();
    out.extend_from_slice(&x.to_le_bytes()[..tail]);
    Bytes::from(out)
}

/// Folds `bytes` into a running checksum (order-sensitive, word-wise for speed).
pub fn checksum(mut state: u64, bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        state = (state ^ u64::from_le_bytes(w))
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }
    for &b in words.remainder() {
        state = (state ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    state ^ bytes.len() as u64
}
