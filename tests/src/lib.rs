//! Shared helpers for the cross-crate tests live in `tests/tests/integration/common.rs`; this library is empty.
