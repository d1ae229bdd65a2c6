//! Cross-crate and multi-process tests of wrk, in one test binary: each module covers one area and
//! `common` holds what they share. One binary rather than one per file: every test binary links
//! wasmtime, Arrow and kube (about 300 MB each in a debug build), and the guests and the `wrk`
//! binary they run are built once for all of them. (`tests/tests/metrics.rs` has a binary of its
//! own: it needs a process no other embedded cluster has run in.)

mod common;

mod bad_guests;
mod dashboard;
mod device;
mod engine;
mod examples;
mod gpu_worker;
mod lifecycle;
mod memory;
mod monitoring;
mod object_store;
mod operator_k8s;
mod placement;
mod recovery;
mod shuffle;
mod taxi;
mod tenants;
