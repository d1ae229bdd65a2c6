//! Shared helpers for the cross-crate tests live in `tests/tests/common`; this library is empty.
