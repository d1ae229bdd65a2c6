#!/usr/bin/env bash
# Everything that needs a GPU, in one command, for a machine that has one (no CUDA toolkit
# needed: the driver comes with the machine, NVRTC from the PyPI wheel or the machine's CUDA).
#
#   host/gpu-check.sh                 # every step below
#   host/gpu-check.sh bench peers     # some of them
#   BENCH_ROWS=5000000 host/gpu-check.sh
#
# Where cargo is, it builds what it runs. Where it is not (the GPU machines lent to this
# project have no Rust toolchain and no package index), it runs the prebuilt binaries of
# target/gpu-bundle/bundle.tar.xz, which host/gpu-bundle.sh makes on a build machine; carry
# target/gpu-bundle there with the working tree (WRK_GPU_BUNDLE=1 uses the bundle even where
# cargo is). Each step's output goes to $OUT/<step>.log (target/gpu-check/ without $OUT), and
# one line per step to $OUT/summary.txt. The steps:
#
#   host          every wrk-host test with WRK_REQUIRE_GPU=1 and WRK_REQUIRE_NVRTC=1 (a test
#                 that would skip for want of a GPU or NVRTC fails instead): the device
#                 self-test against the CPU backend on 0 .. 1.1 M rows, every kernel compiled to
#                 PTX, the table round trip, device selection, NVML telemetry
#   bench         the device operator benchmark (release): haversine as one fused kernel with
#                 its effective bandwidth against the card's, group-by, join, sort and
#                 hash-partition, GPU next to the CPU backend
#   integration   the device CLI tests and the example jobs on a `wrk worker --device gpu:0`
#                 process against the reference and a CPU cluster (tests/tests/integration/
#                 device.rs and gpu_worker.rs)
#   cluster       a scheduler and a `wrk worker --device gpu:0`: `wrk status` (device name, MIG
#                 profile, memory, SM utilisation, temperature, power), the worker's wrk_gpu_*
#                 series and its device log line
#   peers         the benchmark's operators in cuDF on the same card (host/gpu-peers.py), next
#                 to wrk's times from the last bench step on this machine; a skip line where
#                 cuDF is not installed (host/gpu-wheels.sh's, found by its env.sh)
#   engine        the engine benchmark's queries (guest-examples/engine-bench/engines.py) over
#                 ENGINE_ROWS (20 M) trips written by `wrk gen-taxi`: wrk with one worker (of
#                 ENGINE_SLOTS, 8, slots) on the GPU next to the peers that import here (cuDF
#                 on the same card, after host/gpu-wheels.sh); not in the default steps
#   profile       the bench step under Nsight Compute (ncu, where the machine has it): every
#                 kernel's time, summed per kernel by host/gpu-profile.py, the largest first
#                 ($OUT/ncu.csv holds each launch); then the fused kernels' launches in detail
#                 (throughput, FP64 pipe, occupancy, stalls: $OUT/ncu-fused.txt); not in the
#                 default steps
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-$root/target/gpu-check}
# Every step's log is kept here too, for later calls on the same machine ($OUT starts empty each
# call): `peers` compares cuDF with the `bench` of an earlier call.
last=$root/target/gpu-check-last
mkdir -p "$out" "$last"
steps=("$@")
# The quick whole-path check first (a worker starting on the GPU runs its self-test), then the
# figures, then the long test steps: what a run cut short leaves is the most telling part.
[ ${#steps[@]} -gt 0 ] || steps=(cluster bench host integration peers)
bundle=target/gpu-bundle/bundle.tar.xz

if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L || true
fi

if command -v cargo >/dev/null && [ "${WRK_GPU_BUNDLE:-0}" != 1 ]; then
    mode=cargo
elif [ -f "$bundle" ]; then
    mode=bundle
else
    echo "gpu-check: no cargo here and no $bundle: run host/gpu-bundle.sh where cargo is and carry target/gpu-bundle" >&2
    exit 2
fi

if [ "$mode" = bundle ]; then
    unpacked=$root/target/gpu-bundle/unpacked
    rm -rf "$unpacked"
    mkdir -p "$unpacked"
    xz -dc "$bundle" | tar -C "$unpacked" -xf - || exit 2
    # (Not compared with this tree's HEAD: the lent machines receive the files, and a .git there
    # can be older than them.)
    echo "gpu-check: the bundle of commit $(cat "$unpacked/commit")"
    export WRK_TEST_ARTIFACTS=$unpacked WRK_WORKSPACE_ROOT=$root
    wrk=$unpacked/wrk
    host_tests=("$unpacked/wrk-host-tests")
    integration=("$unpacked/integration")
    engine_module=$unpacked/engine_bench.wasm
else
    cargo build -q --release -p wrk-cli --bin wrk || exit 2
    wrk=$root/target/release/wrk
    host_tests=(cargo test --release -p wrk-host --lib --)
    integration=(cargo test -p wrk-tests --test integration --)
    engine_module=$root/target/wasm32-wasip2/release/engine_bench.wasm
    if [[ " ${steps[*]} " == *" engine "* ]]; then
        cargo build -q --release --target wasm32-wasip2 -p engine-bench || exit 2
    fi
fi

# NVRTC: the bundle's, else the wheel's (host/nvrtc-wheel.sh, where cargo is), else the
# machine's CUDA install. cudarc loads `libnvrtc.so` or `libnvrtc.so.12` (and older), so a newer
# one (libnvrtc.so.13) is linked as `libnvrtc.so`.
nvrtc=
if [ "$mode" = bundle ] && [ -e "$unpacked/nvrtc/libnvrtc.so.12" ]; then
    nvrtc=$unpacked/nvrtc/libnvrtc.so.12
elif [ "$mode" = cargo ] && wheel_lib=$(host/nvrtc-wheel.sh); then
    nvrtc=$wheel_lib/libnvrtc.so.12
fi
if [ -z "$nvrtc" ]; then
    sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
    for candidate in /usr/local/cuda/lib64/libnvrtc.so.* /usr/local/cuda-*/lib64/libnvrtc.so.* \
        /usr/lib/x86_64-linux-gnu/libnvrtc.so.* \
        $(for s in $sites; do echo "$s"/nvidia/*/lib/libnvrtc.so.* "$s"/nvidia/cuda_nvrtc/lib/libnvrtc.so.*; done); do
        case $candidate in *builtins* | *alt*) continue ;; esac
        if [ -e "$candidate" ]; then
            nvrtc=$candidate
            break
        fi
    done
fi
if [ -n "$nvrtc" ]; then
    links=$root/target/gpu-check-nvrtc
    rm -rf "$links"
    mkdir -p "$links"
    ln -s "$nvrtc" "$links/libnvrtc.so"
    export LD_LIBRARY_PATH="$links:$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu-check: NVRTC $nvrtc"
else
    echo "gpu-check: no NVRTC found; the GPU steps will fail saying so" >&2
fi
# A dry run where there is no GPU (the tests then use the CUDA emulator): WRK_REQUIRE_GPU=0
# WRK_REQUIRE_NVRTC=0 WRK_CHECK_DEVICE=emulated-gpu.
export WRK_REQUIRE_GPU=${WRK_REQUIRE_GPU:-1} WRK_REQUIRE_NVRTC=${WRK_REQUIRE_NVRTC:-1}
device=${WRK_CHECK_DEVICE:-gpu:0}

failed=()
# step NAME SECONDS COMMAND...: runs COMMAND (killed after SECONDS), its output in
# $out/NAME.log as well as here, and notes how it ended in $out/summary.txt.
step() {
    local name=$1 limit=$2 started=$SECONDS status
    shift 2
    echo "== $name"
    timeout --signal=KILL "$limit" "$@" 2>&1 | tee "$out/$name.log" "$last/$name.log"
    status=${PIPESTATUS[0]}
    echo "$name: exit $status after $((SECONDS - started)) s" | tee -a "$out/summary.txt"
    [ "$status" = 0 ] || failed+=("$name")
}

export wrk out device engine_module
cluster() {
    local log=$out/cluster-processes.txt scheduler worker registered=no
    "$wrk" scheduler --listen 127.0.0.1:17070 --http-listen 127.0.0.1:17087 --heartbeat-ms 200 2>"$log" &
    scheduler=$!
    WRK_LOG=info "$wrk" worker --scheduler http://127.0.0.1:17070 --device "$device" \
        --metrics-listen 127.0.0.1:17090 --id gpu-check 2>>"$log" &
    worker=$!
    for _ in $(seq 1 300); do
        if "$wrk" status --scheduler http://127.0.0.1:17070 2>/dev/null | grep -q "gpu-check"; then
            registered=yes
            break
        fi
        if ! kill -0 "$worker" 2>/dev/null; then break; fi
        sleep 0.2
    done
    sleep 1
    "$wrk" status --scheduler http://127.0.0.1:17070
    curl -s http://127.0.0.1:17090/metrics | grep -E "^wrk_(gpu|worker_device)" ||
        python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:17090/metrics").read().decode())' |
        grep -E "^wrk_(gpu|worker_device)"
    grep -E "uses (GPU|the CPU)|GPU|rror" "$log" | head -n 40
    kill "$worker" "$scheduler" 2>/dev/null
    wait "$worker" "$scheduler" 2>/dev/null
    if [ "$registered" != yes ]; then
        echo "the worker on $device did not register; its log:"
        tail -n 40 "$log"
        return 1
    fi
}

# cuDF where host/gpu-wheels.sh put it: its packages and libraries, for the steps that compare
# with it (peers, engine).
cudf_env=${WRK_CUDF_SITE:-/tmp/wrk-cudf}/env.sh
export cudf_env last
with_cudf() {
    if [ -f "$cudf_env" ]; then
        . "$cudf_env"
    fi
}

peers() {
    with_cudf
    python3 host/gpu-peers.py --wrk "$last/bench.log"
}

# The benchmark again under Nsight Compute: each kernel launch's time, summed per kernel
# (host/gpu-profile.py). Takes the test binary's command as its arguments.
profile() {
    local ncu
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null |
        head -n 1)
    if [ -z "$ncu" ]; then
        echo "SKIPPED profile: no ncu (Nsight Compute) on this machine"
        return 0
    fi
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        "$@" gpu::bench --ignored --nocapture >"$out/ncu.csv" || return 1
    python3 host/gpu-profile.py "$out/ncu.csv"
    # The fused kernels (haversine, column-add) in detail: what bounds them (memory, FP64
    # pipe, latency), their registers and occupancy, and where their warps stall.
    "$ncu" --clock-control none -k regex:wrk_fused --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section InstructionStats \
        --metrics sm__inst_executed_pipe_fp64.avg.pct_of_peak_sustained_active,sm__pipe_fp64_cycles_active.avg.pct_of_peak_sustained_active \
        "$@" gpu::bench --ignored --nocapture >"$out/ncu-fused.txt" || return 1
    grep -E "wrk_fused|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|fp64|Stall|Issued Ipc|Executed Ipc|Grid Size" \
        "$out/ncu-fused.txt" | head -n 400
}

engine() {
    with_cudf
    local rows=${ENGINE_ROWS:-20000000}
    local drivers=$((rows / 4))
    if [ ! -f "data/bench/rows-$rows-drivers-$drivers" ]; then
        rm -rf data/bench
        "$wrk" gen-taxi --out data/bench/taxi --rows "$rows" --files 8 --row-group-rows 500000 \
            --drivers "$drivers" --dimensions data/bench || return 1
        touch "data/bench/rows-$rows-drivers-$drivers"
    fi
    WRK=$wrk WRK_BENCH_MODULE=$engine_module WRK_BENCH_DEVICE=$device WORKERS=1 \
        WRK_BENCH_SLOTS=${ENGINE_SLOTS:-8} python3 guest-examples/engine-bench/engines.py
}

: >"$out/summary.txt"
for s in "${steps[@]}"; do
    case $s in
    host) step host 300 "${host_tests[@]}" --nocapture ;;
    bench) step bench 300 "${host_tests[@]}" gpu::bench --ignored --nocapture ;;
    integration) step integration 300 "${integration[@]}" device:: gpu_worker:: --nocapture ;;
    cluster) step cluster 90 bash -c "$(declare -f cluster); cluster" ;;
    peers) step peers 300 bash -c "$(declare -f with_cudf peers); peers" ;;
    engine) step engine 400 bash -c "$(declare -f with_cudf engine); engine" ;;
    profile) step profile 300 bash -c "$(declare -f profile); profile \"\$@\"" _ "${host_tests[@]}" ;;
    *)
        echo "gpu-check: unknown step $s (cluster, bench, host, integration, peers, engine, profile)" >&2
        exit 2
        ;;
    esac
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-check: failed: ${failed[*]}" | tee -a "$out/summary.txt"
    exit 1
fi
