#!/usr/bin/env bash
# The engine benchmark: wrk against Polars, DuckDB and DataFusion on the same 20 M-row taxi
# dataset (and 5 M-row drivers table), on the same cores, in one run. Builds wrk and the
# benchmark guest in release mode, writes data/bench once, installs the peers into
# target/bench-venv, then runs engines.py. ROWS, DRIVERS, WORKERS and RUNS override;
# WRK_BENCH_DEVICE=gpu:0 (with WORKERS=1) runs wrk's side on the GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
rows=${ROWS:-20000000}
drivers=${DRIVERS:-5000000}
rustup target add wasm32-wasip2 >/dev/null
cargo build --release -q -p wrk-cli
cargo build --release -q --target wasm32-wasip2 -p engine-bench
if [ ! -f "data/bench/rows-$rows-drivers-$drivers" ]; then
    rm -rf data/bench
    target/release/wrk gen-taxi --out data/bench/taxi --rows "$rows" --files 8 \
        --row-group-rows 500000 --drivers "$drivers" --dimensions data/bench
    touch "data/bench/rows-$rows-drivers-$drivers"
fi
if [ ! -x target/bench-venv/bin/python ]; then
    python3 -m venv target/bench-venv
fi
target/bench-venv/bin/pip install -q polars duckdb datafusion numpy pyarrow
exec target/bench-venv/bin/python guest-examples/engine-bench/engines.py
