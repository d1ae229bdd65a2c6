#!/usr/bin/env bash
# End-to-end shuffle join on the engine benchmark's tables (20 M trips, 5 M drivers; written by
# guest-examples/engine-bench/bench.sh into data/bench): wrk's shuffle-join example on an embedded
# cluster of WORKERS workers (default 2), then Dask's P2P shuffle merge of the same tables with as
# many worker processes, in one run. Installs dask into target/bench-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
workers=${WORKERS:-2}
if [ ! -d data/bench/taxi ] || [ ! -d data/bench/drivers ]; then
    echo "data/bench is missing: run guest-examples/engine-bench/bench.sh first" >&2
    exit 1
fi
rustup target add wasm32-wasip2 >/dev/null
cargo build --release -q -p wrk-cli
cargo build --release -q --target wasm32-wasip2 -p shuffle-join
if [ ! -x target/bench-venv/bin/python ]; then
    python3 -m venv target/bench-venv
fi
target/bench-venv/bin/pip install -q "dask[distributed,dataframe]" pyarrow
echo "== wrk shuffle join, $workers workers"
start=$(date +%s.%N)
target/release/wrk submit guest-examples/shuffle-join/job.toml --workers "$workers" \
    --source trips=data/bench/taxi --source drivers=data/bench/drivers
end=$(date +%s.%N)
echo "wrk shuffle join, $workers workers: $(echo "$end - $start" | bc) s (including the cluster's start)"
echo "== Dask"
target/bench-venv/bin/python guest-examples/shuffle-join/dask_merge.py \
    data/bench/taxi data/bench/drivers "$workers"
