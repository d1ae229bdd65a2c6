//! Peer addresses as published by [`crate::Ucx::address`]: UCX's packed worker address
//! (`ucp_worker_get_address`) in a small envelope, so that bytes that are not an address are
//! refused with [`UcxError::InvalidAddress`] before they reach UCX (`ucp_ep_create` takes no
//! length and trusts the bytes it is given).
//!
//! Layout: `b"WUCX"`, format version (1 byte, = 1), 3 zero bytes, length of the UCX address
//! (u32 little endian), the UCX address, FNV-1a 64 of everything before it (u64 little endian).

use crate::error::UcxError;

const MAGIC: &[u8; 4] = b"WUCX";
const FORMAT: u8 = 1;
const PREFIX: usize = 12;
const SUFFIX: usize = 8;

/// FNV-1a, 64 bits: a cheap checksum against truncated or foreign bytes (not against forgery).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// Wraps UCX's worker address bytes into the published form.
pub(crate) fn encode(ucx_address: &[u8]) -> Result<Vec<u8>, UcxError> {
    let len = u32::try_from(ucx_address.len()).map_err(|_| UcxError::InvalidAddress {
        reason: "UCX worker address longer than 4 GiB",
    })?;
    let mut out = Vec::with_capacity(PREFIX + ucx_address.len() + SUFFIX);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[FORMAT, 0, 0, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(ucx_address);
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

/// Checks a published address and returns the UCX address bytes inside it.
pub(crate) fn decode(published: &[u8]) -> Result<&[u8], UcxError> {
    let invalid = |reason| UcxError::InvalidAddress { reason };
    if published.len() < PREFIX + SUFFIX {
        return Err(invalid("too short"));
    }
    let (head, rest) = published.split_at(PREFIX);
    if &head[..4] != MAGIC {
        return Err(invalid("not a wrk UCX address (bad magic)"));
    }
    if head[4] != FORMAT {
        return Err(invalid("unknown address format version"));
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&head[8..12]);
    let len = u32::from_le_bytes(len) as usize;
    if rest.len() != len + SUFFIX {
        return Err(invalid("length does not match (truncated?)"));
    }
    let (body, sum) = published.split_at(PREFIX + len);
    let mut expected = [0u8; 8];
    expected.copy_from_slice(sum);
    if fnv1a(body) != u64::from_le_bytes(expected) {
        return Err(invalid("checksum mismatch"));
    }
    Ok(&body[PREFIX..])
}

/// A short printable id of a peer for errors and logs: the hash of its published address.
pub(crate) fn peer_id(published: &[u8]) -> String {
    format!("{:016x}", fnv1a(published))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejections() {
        let inner = b"some ucx address bytes".to_vec();
        let published = encode(&inner).unwrap();
        assert_eq!(decode(&published).unwrap(), &inner[..]);

        assert!(decode(b"").is_err());
        assert!(decode(&published[..published.len() - 1]).is_err());
        let mut flipped = published.clone();
        flipped[PREFIX + 3] ^= 1;
        assert!(matches!(
            decode(&flipped),
            Err(UcxError::InvalidAddress {
                reason: "checksum mismatch"
            })
        ));
        let mut magic = published.clone();
        magic[0] = b'X';
        assert!(decode(&magic).is_err());
        let mut longer = published.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
    }
}
