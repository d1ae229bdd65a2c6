//! Compiles `proto/wrk.proto` with `protox` (pure Rust), so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/wrk.proto");
    let descriptors = protox::compile(["proto/wrk.proto"], ["proto"])?;
    tonic_prost_build::configure()
        // Transfer chunks are slices of the partitions' own buffers, not copies.
        .bytes(".wrk.v1.DataChunk.ipc")
        .compile_fds(descriptors)?;
    Ok(())
}
