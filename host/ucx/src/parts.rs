//! Messages sent in parts: the wire format and the bookkeeping on both sides.
//!
//! UCX 1.13 moves a payload given as an I/O vector through its copy pipeline, but a contiguous
//! buffer above the rendezvous threshold with a single copy (CMA on one host, zero-copy RDMA
//! between hosts). With [`crate::UcxConfig::part_threshold`] set, a message whose payload has
//! large segments (Arrow buffers) is sent as several active messages (id [`PART_AM_ID`]), one
//! per part: each large segment alone, as a contiguous buffer, and the small segments between
//! them gathered into one part each.
//!
//! Every part carries a [`PartHeader`] (40 bytes, little endian: the sending stream's id, the
//! message's sequence number, the part's index and the message's part count as u32, the part's
//! offset in the payload and the payload's total length as u64); part 0 also carries the
//! caller's header after it. The receiver allocates one buffer of the total length when the
//! first part arrives, whichever it is, receives every part at its offset, and delivers the
//! message once its parts tile the payload exactly ([`Tiling`]). Offsets within the payload are
//! those of the sender's segments, so data that was aligned in the sender's payload is aligned
//! the same way in the receiver's buffer.

use std::ops::Range;

use bytes::Bytes;

/// The active-message id of message parts.
pub(crate) const PART_AM_ID: u32 = 0x5753;
/// Bytes of the [`PartHeader`] in front of every part's wire header.
pub(crate) const PART_PREFIX: usize = 40;
/// Most parts one message may have (a sender splits far fewer; the receiver refuses more).
pub(crate) const MAX_PARTS: u32 = 1 << 16;

/// Where one part belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartHeader {
    pub stream: u64,
    pub seq: u64,
    pub index: u32,
    pub count: u32,
    pub offset: u64,
    pub total: u64,
}

/// Why a part was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PartError {
    #[error("a message part header of {0} bytes, shorter than the {PART_PREFIX}-byte prefix")]
    Short(usize),
    #[error("a message part claims {count} parts (at most {MAX_PARTS}, at least 2)")]
    Count { count: u32 },
    #[error("message part {index} of a message of {count} parts")]
    Index { index: u32, count: u32 },
    #[error("a caller's header on message part {index}: only part 0 carries one")]
    Header { index: u32 },
    #[error("message part {index} ({len} bytes at {offset}) lies outside the {total}-byte payload")]
    Outside {
        index: u32,
        offset: u64,
        len: u64,
        total: u64,
    },
    #[error(
        "message part {index} says {count} parts and {total} bytes; an earlier part said {expected_count} and {expected_total}"
    )]
    Inconsistent {
        index: u32,
        count: u32,
        total: u64,
        expected_count: u32,
        expected_total: u64,
    },
    #[error("message part {index} arrived twice")]
    Duplicate { index: u32 },
    #[error(
        "the parts of a message do not tile its {total}-byte payload: a gap or overlap at byte {at}"
    )]
    Gap { at: u64, total: u64 },
    #[error("a message of {total} bytes, over the limit of {max} bytes")]
    TooLarge { total: u64, max: u64 },
}

impl PartHeader {
    /// The wire header of this part: the prefix, then `user` (part 0's caller header, or none).
    pub(crate) fn encode(&self, user: &[u8]) -> Vec<u8> {
        let mut wire = Vec::with_capacity(PART_PREFIX + user.len());
        wire.extend_from_slice(&self.stream.to_le_bytes());
        wire.extend_from_slice(&self.seq.to_le_bytes());
        wire.extend_from_slice(&self.index.to_le_bytes());
        wire.extend_from_slice(&self.count.to_le_bytes());
        wire.extend_from_slice(&self.offset.to_le_bytes());
        wire.extend_from_slice(&self.total.to_le_bytes());
        wire.extend_from_slice(user);
        wire
    }

    /// Parses and checks a part's wire header; returns the part and the caller's header.
    pub(crate) fn decode(wire: &[u8]) -> Result<(PartHeader, &[u8]), PartError> {
        let Some((prefix, user)) = wire.split_first_chunk::<PART_PREFIX>() else {
            return Err(PartError::Short(wire.len()));
        };
        let u64_at = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&prefix[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        let u32_at = |at: usize| {
            let mut bytes = [0u8; 4];
            bytes.copy_from_slice(&prefix[at..at + 4]);
            u32::from_le_bytes(bytes)
        };
        let header = PartHeader {
            stream: u64_at(0),
            seq: u64_at(8),
            index: u32_at(16),
            count: u32_at(20),
            offset: u64_at(24),
            total: u64_at(32),
        };
        if !(2..=MAX_PARTS).contains(&header.count) {
            return Err(PartError::Count {
                count: header.count,
            });
        }
        if header.index >= header.count {
            return Err(PartError::Index {
                index: header.index,
                count: header.count,
            });
        }
        if header.index != 0 && !user.is_empty() {
            return Err(PartError::Header {
                index: header.index,
            });
        }
        Ok((header, user))
    }
}

/// One part of an outgoing payload: a run of its segments and where they start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Part {
    pub segments: Range<usize>,
    pub offset: u64,
}

/// Splits a payload into parts: every segment of at least `threshold` bytes alone, the runs of
/// smaller segments between them together; empty segments go with their neighbours. One part
/// (or none, for an empty payload) means the payload is best sent whole.
pub(crate) fn plan(segments: &[Bytes], threshold: usize) -> Vec<Part> {
    let mut parts = Vec::new();
    let mut run: Option<Part> = None;
    let mut offset = 0u64;
    for (i, segment) in segments.iter().enumerate() {
        if segment.len() >= threshold.max(1) {
            parts.extend(run.take());
            parts.push(Part {
                segments: i..i + 1,
                offset,
            });
        } else {
            let part = run.get_or_insert(Part {
                segments: i..i,
                offset,
            });
            part.segments.end = i + 1;
        }
        offset += segment.len() as u64;
    }
    parts.extend(run);
    // A run of empty segments carries nothing: fold it into the part before it.
    parts.retain(|part| {
        segments[part.segments.clone()]
            .iter()
            .any(|s| !s.is_empty())
    });
    parts
}

/// Which parts of an incoming message arrived, and where they lie.
#[derive(Debug)]
pub(crate) struct Tiling {
    count: u32,
    total: u64,
    /// `(offset, len)` of each part that arrived, by index.
    placed: Vec<Option<(u64, u64)>>,
    arrived: u32,
}

impl Tiling {
    /// The tiling of a message as its first part describes it; refused over `max` bytes.
    pub(crate) fn new(first: &PartHeader, max: u64) -> Result<Tiling, PartError> {
        if first.total > max {
            return Err(PartError::TooLarge {
                total: first.total,
                max,
            });
        }
        Ok(Tiling {
            count: first.count,
            total: first.total,
            placed: vec![None; first.count as usize],
            arrived: 0,
        })
    }

    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Records part `header` of `len` bytes; refused unless it belongs to this message, lies
    /// within the payload and is new.
    pub(crate) fn place(&mut self, header: &PartHeader, len: u64) -> Result<(), PartError> {
        if header.count != self.count || header.total != self.total {
            return Err(PartError::Inconsistent {
                index: header.index,
                count: header.count,
                total: header.total,
                expected_count: self.count,
                expected_total: self.total,
            });
        }
        let outside = PartError::Outside {
            index: header.index,
            offset: header.offset,
            len,
            total: self.total,
        };
        match header.offset.checked_add(len) {
            Some(end) if end <= self.total => {}
            _ => return Err(outside),
        }
        let slot = self
            .placed
            .get_mut(header.index as usize)
            .ok_or(PartError::Index {
                index: header.index,
                count: self.count,
            })?;
        if slot.is_some() {
            return Err(PartError::Duplicate {
                index: header.index,
            });
        }
        *slot = Some((header.offset, len));
        self.arrived += 1;
        Ok(())
    }

    /// Whether every part has arrived.
    pub(crate) fn is_complete(&self) -> bool {
        self.arrived == self.count
    }

    /// Checks that the parts, in index order, cover the payload exactly once (so every byte of
    /// the buffer was written).
    pub(crate) fn check(&self) -> Result<(), PartError> {
        let mut at = 0u64;
        for placed in &self.placed {
            match placed {
                Some((offset, len)) if *offset == at => at += len,
                _ => {
                    return Err(PartError::Gap {
                        at,
                        total: self.total,
                    });
                }
            }
        }
        if at == self.total {
            Ok(())
        } else {
            Err(PartError::Gap {
                at,
                total: self.total,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(index: u32, count: u32, offset: u64, total: u64) -> PartHeader {
        PartHeader {
            stream: 0x0123_4567_89ab_cdef,
            seq: 42,
            index,
            count,
            offset,
            total,
        }
    }

    fn segments(sizes: &[usize]) -> Vec<Bytes> {
        sizes.iter().map(|&n| Bytes::from(vec![7u8; n])).collect()
    }

    #[test]
    fn headers_round_trip_with_the_callers_header_on_part_zero() {
        let part = header(0, 3, 0, 1 << 40);
        let wire = part.encode(b"piece 7");
        assert_eq!(wire.len(), PART_PREFIX + 7);
        assert_eq!(PartHeader::decode(&wire), Ok((part, &b"piece 7"[..])));
        let later = header(2, 3, 99, 1 << 40);
        assert_eq!(PartHeader::decode(&later.encode(&[])), Ok((later, &[][..])));
    }

    #[test]
    fn short_and_malformed_headers_are_refused() {
        let wire = header(0, 3, 0, 100).encode(b"x");
        for len in [0, 1, 16, PART_PREFIX - 1] {
            assert_eq!(PartHeader::decode(&wire[..len]), Err(PartError::Short(len)));
        }
        let refused = |part: PartHeader, user: &[u8]| {
            PartHeader::decode(&part.encode(user)).map(|(part, _)| part)
        };
        assert_eq!(
            refused(header(0, 1, 0, 100), &[]),
            Err(PartError::Count { count: 1 })
        );
        assert_eq!(
            refused(header(0, MAX_PARTS + 1, 0, 100), &[]),
            Err(PartError::Count {
                count: MAX_PARTS + 1
            })
        );
        assert_eq!(
            refused(header(3, 3, 0, 100), &[]),
            Err(PartError::Index { index: 3, count: 3 })
        );
        assert_eq!(
            refused(header(1, 3, 0, 100), b"stray"),
            Err(PartError::Header { index: 1 })
        );
    }

    #[test]
    fn large_segments_go_alone_and_small_ones_together() {
        let plan = plan(&segments(&[8, 0, 100, 4096, 16, 4096, 4096, 3, 0]), 1024);
        let runs: Vec<(Range<usize>, u64)> =
            plan.into_iter().map(|p| (p.segments, p.offset)).collect();
        assert_eq!(
            runs,
            [
                (0..3, 0),
                (3..4, 108),
                (4..5, 4204),
                (5..6, 4220),
                (6..7, 8316),
                (7..9, 12412),
            ]
        );
    }

    #[test]
    fn payloads_without_large_segments_are_one_part() {
        assert_eq!(plan(&segments(&[10, 20, 30]), 1024).len(), 1);
        assert_eq!(plan(&segments(&[5000]), 1024).len(), 1);
        assert!(plan(&segments(&[0, 0]), 1024).is_empty());
        // Empty segments after the last large one add no part.
        assert_eq!(plan(&segments(&[10, 5000, 0]), 1024).len(), 2);
    }

    #[test]
    fn parts_that_tile_the_payload_complete_it() {
        let mut tiling = Tiling::new(&header(0, 3, 0, 300), 1000).unwrap();
        tiling.place(&header(2, 3, 200, 300), 100).unwrap();
        tiling.place(&header(0, 3, 0, 300), 150).unwrap();
        assert!(!tiling.is_complete());
        tiling.place(&header(1, 3, 150, 300), 50).unwrap();
        assert!(tiling.is_complete());
        assert_eq!(tiling.check(), Ok(()));
    }

    #[test]
    fn parts_that_do_not_belong_are_refused() {
        assert_eq!(
            Tiling::new(&header(0, 2, 0, 1 << 40), 1 << 30).unwrap_err(),
            PartError::TooLarge {
                total: 1 << 40,
                max: 1 << 30
            }
        );
        let mut tiling = Tiling::new(&header(1, 2, 0, 100), 1000).unwrap();
        assert!(matches!(
            tiling.place(&header(0, 2, 60, 100), 50),
            Err(PartError::Outside { .. })
        ));
        assert!(matches!(
            tiling.place(&header(0, 2, u64::MAX, 100), 2),
            Err(PartError::Outside { .. })
        ));
        assert!(matches!(
            tiling.place(&header(0, 3, 0, 100), 50),
            Err(PartError::Inconsistent { .. })
        ));
        tiling.place(&header(0, 2, 0, 100), 50).unwrap();
        assert_eq!(
            tiling.place(&header(0, 2, 0, 100), 50),
            Err(PartError::Duplicate { index: 0 })
        );
        // Both parts arrived, but they overlap and leave the end unwritten.
        tiling.place(&header(1, 2, 40, 100), 60).unwrap();
        assert!(tiling.is_complete());
        assert_eq!(tiling.check(), Err(PartError::Gap { at: 50, total: 100 }));
    }
}
