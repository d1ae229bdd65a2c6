#!/usr/bin/env bash
# Per-task overhead, side by side in one run, through wrk's embedded local cluster (2 workers) and
# dask.distributed's LocalCluster (2 worker processes): 20,000 independent no-op tasks, then the
# 3-stage graph of 10,000 no-op tasks in graph.toml. Installs its peer (dask[distributed]) into
# target/bench-venv. TASKS (the independent count) and WORKERS override.
set -euo pipefail
cd "$(dirname "$0")/../.."
tasks=${TASKS:-20000}
workers=${WORKERS:-2}
rustup target add wasm32-wasip2 >/dev/null
cargo build --release -q -p wrk-cli
cargo build --release -q --target wasm32-wasip2 -p noop
if [ ! -x target/bench-venv/bin/python ]; then
    python3 -m venv target/bench-venv
    target/bench-venv/bin/pip install -q 'dask[distributed]'
fi
echo "machine: $(nproc) cores; $(date -u +%Y-%m-%d)"
cache=$(mktemp -d)
job=$(mktemp --suffix .toml)
trap 'rm -rf "$cache" "$job"' EXIT
sed "s/^tasks = .*/tasks = $tasks/; s#^module = .*#module = \"$PWD/target/wasm32-wasip2/release/noop.wasm\"#" \
    guest-examples/noop/job.toml > "$job"
# First run compiles the module into the cache; the second measures the steady state.
target/release/wrk submit "$job" --workers "$workers" --cache-dir "$cache" --quiet 2>&1 | grep succeeded | sed 's/^/wrk (cold cache):   /'
target/release/wrk submit "$job" --workers "$workers" --cache-dir "$cache" --quiet 2>&1 | grep succeeded | sed 's/^/wrk (warm cache):   /'
# Dask logs connection noise while its cluster shuts down: keep only the result line.
target/bench-venv/bin/python guest-examples/noop/dask_noop.py "$tasks" "$workers" 2>/dev/null
# The 3-stage graph of 10,000 tasks (graph.toml), on both.
sed "s#^module = .*#module = \"$PWD/target/wasm32-wasip2/release/noop.wasm\"#" \
    guest-examples/noop/graph.toml > "$job"
target/release/wrk submit "$job" --workers "$workers" --cache-dir "$cache" --quiet 2>&1 | grep succeeded | sed 's/^/wrk (3-stage graph): /'
target/bench-venv/bin/python guest-examples/noop/dask_noop.py graph "$workers" 2>/dev/null
