//! The CPU backend: expressions and table operators over Arrow arrays in host memory.
//!
//! Used when a worker has no GPU; it is also the reference the CUDA backend is tested against.

pub mod eval;
mod fused;
pub mod join;
mod keys;
pub mod ops;
pub mod partition;
pub mod sort;
