#!/usr/bin/env bash
# Everything that needs a GPU, in one command, for a machine that has one (no CUDA toolkit
# needed: the driver comes with the machine, NVRTC from the PyPI wheel tests/run.sh installs).
#
#   host/gpu-check.sh            # GPU tests (failing, not skipping, without a GPU) + benchmark
#   BENCH_ROWS=5000000 host/gpu-check.sh
#
# 1. Probes the device (nvidia-smi, if present).
# 2. Runs every test of wrk-host and the device CLI test with WRK_REQUIRE_GPU=1 (and
#    WRK_REQUIRE_NVRTC=1): a test that would skip for want of a GPU or NVRTC fails instead. These
#    include the device self-test against the CPU backend on 0 .. 1.1 M rows, the table
#    round-trip, device selection and NVML telemetry.
# 3. Runs the device operator benchmark (release build): the haversine fused kernel with its
#    effective bandwidth, group-by, join, sort and hash-partition, GPU next to the CPU backend.
# 4. Runs example jobs on a `wrk worker --device gpu:0` process against the reference and a CPU
#    cluster (tests/tests/integration/gpu_worker.rs; it uses the GPU where one is found).
# 5. Starts a scheduler and a `wrk worker --device gpu:0`, and prints `wrk status` (device name,
#    MIG profile, memory, SM utilisation, temperature, power) and the worker's wrk_gpu_* series.
# The engine benchmark on the GPU (it needs its Python peers installed, from PyPI):
#   WRK_BENCH_DEVICE=gpu:0 WORKERS=1 guest-examples/engine-bench/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L || true
fi
# NVRTC from PyPI, as tests/run.sh installs it.
NVRTC_VENV=target/nvrtc-venv
if ! ls "$NVRTC_VENV"/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 >/dev/null 2>&1; then
    python3 -m venv "$NVRTC_VENV"
    "$NVRTC_VENV/bin/pip" install -q --disable-pip-version-check "nvidia-cuda-nvrtc-cu12==12.9.86"
fi
lib=$(ls -d "$PWD/$NVRTC_VENV"/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib | head -n 1)
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export WRK_REQUIRE_GPU=1 WRK_REQUIRE_NVRTC=1

echo "== GPU tests (WRK_REQUIRE_GPU=1)"
cargo test -p wrk-host -- --nocapture
cargo test -p wrk-tests --test integration device:: -- --nocapture

echo "== example jobs on a GPU worker"
cargo test -p wrk-tests --test integration gpu_worker:: -- --nocapture

echo "== device operator benchmark (release)"
cargo test --release -p wrk-host gpu::bench -- --ignored --nocapture

echo "== a GPU worker in a cluster"
cargo build -q -p wrk-cli
log=$(mktemp)
target/debug/wrk scheduler --listen 127.0.0.1:17070 --http-listen 127.0.0.1:17087 --heartbeat-ms 200 2>"$log" &
scheduler=$!
WRK_LOG=info target/debug/wrk worker --scheduler http://127.0.0.1:17070 --device gpu:0 \
    --metrics-listen 127.0.0.1:17090 --id gpu-check 2>>"$log" &
worker=$!
trap 'kill $worker $scheduler 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    if target/debug/wrk status --scheduler http://127.0.0.1:17070 | grep -q "gpu-check"; then break; fi
    sleep 0.2
done
sleep 1
target/debug/wrk status --scheduler http://127.0.0.1:17070
curl -s http://127.0.0.1:17090/metrics | grep -E "^wrk_(gpu|worker_device)" || true
grep -E "uses (GPU|the CPU)" "$log" || true
