#!/usr/bin/env bash
# Runs the taxi haversine job on an embedded local cluster, on a fresh machine: installs the
# wasm32-wasip2 target, builds `wrk` and the task, generates the data set if it is missing.
# ROWS (default 10,000,000) sets the data set size; extra arguments go to `wrk submit`.
set -euo pipefail
cd "$(dirname "$0")/../.."
rustup target add wasm32-wasip2 >/dev/null
cargo build --release -p wrk-cli
cargo build --release --target wasm32-wasip2 -p taxi-haversine
if [ ! -d data/taxi ]; then
    target/release/wrk gen-taxi --rows "${ROWS:-10000000}" --out data/taxi
fi
exec target/release/wrk submit guest-examples/taxi-haversine/job.toml "$@"
