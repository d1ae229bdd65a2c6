#!/usr/bin/env bash
# Builds what host/gpu-check.sh needs on a GPU machine that has no Rust toolchain and no package
# index (the machines lent to this project: see docs/gpu.md, "On a machine with a GPU"), into
# one archive small enough to travel with the working tree:
#
#   host/gpu-bundle.sh          # -> target/gpu-bundle/bundle.tar.xz
#
# It holds, for x86-64 Linux (glibc 2.36 or newer), stripped:
#   wrk               the release binary (scheduler, worker, submit)
#   wrk-host-tests    wrk-host's unit tests in release (the device self-test, kernels, telemetry,
#                     and the ignored device operator benchmark)
#   integration       the multi-process tests (device:: and gpu_worker:: run there), release
#   *.wasm            the example and test guests
#   nvrtc/            only with WRK_BUNDLE_NVRTC=1: NVRTC 12.9 from the PyPI wheel
#                     (host/nvrtc-wheel.sh; the one CI compiles every kernel with), 29 MiB more.
#                     Without it the check uses the NVRTC of the machine's CUDA install, as on
#                     the lent machines (CUDA 13's NVRTC 13.0 compiled every kernel there)
# None of them is built with UCX (the GPU machine has no libucx).
set -euo pipefail
cd "$(dirname "$0")/.."
limit_mib=${WRK_BUNDLE_LIMIT_MIB:-58}
rustup target add wasm32-wasip2 >/dev/null
guests=(taxi-haversine noop fare-stats zone-join top-fares word-count zone-filter shuffle-join
    shuffle-groupby engine-bench test-guest-trap test-guest-spin test-guest-hog test-guest-slow
    test-guest-memory)
cargo build --release --target wasm32-wasip2 $(printf -- '-p %s ' "${guests[@]}")
cargo build --release -p wrk-cli --bin wrk

# The test binaries cargo built, by target name, from its JSON messages.
test_binary() {
    cargo test --release --no-run --message-format=json "$@" |
        python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") \
            and message["profile"]["test"]:
        print(message["executable"])
' | tail -n 1
}
host_tests=$(test_binary -p wrk-host --lib)
integration=$(test_binary -p wrk-tests --test integration)

stage=target/gpu-bundle/stage
rm -rf target/gpu-bundle
mkdir -p "$stage"
cp target/release/wrk "$stage/wrk"
cp "$host_tests" "$stage/wrk-host-tests"
cp "$integration" "$stage/integration"
strip "$stage/wrk" "$stage/wrk-host-tests" "$stage/integration"
for g in "${guests[@]}"; do
    cp "target/wasm32-wasip2/release/${g//-/_}.wasm" "$stage/"
done
if [ "${WRK_BUNDLE_NVRTC:-0}" = 1 ]; then
    lib=$(host/nvrtc-wheel.sh) || {
        echo "no NVRTC to bundle (WRK_BUNDLE_NVRTC=1): run tests/run.sh first, which installs it" >&2
        exit 1
    }
    mkdir -p "$stage/nvrtc"
    cp "$lib"/libnvrtc.so.12 "$lib"/libnvrtc-builtins.so.* "$stage/nvrtc/"
fi
{
    git rev-parse HEAD | tr -d '\n'
    [ -z "$(git status --porcelain --untracked-files=no)" ] || printf ' with uncommitted changes'
    echo
} >"$stage/commit"
# One dictionary over the three binaries, which share most of their code: 22 MiB (51 MiB with
# NVRTC) instead of 59
# (about 5 minutes on one core).
tar -C "$stage" -cf - . | xz -T1 --lzma2=preset=9e,dict=256MiB >target/gpu-bundle/bundle.tar.xz
rm -rf "$stage"
size=$(stat -c %s target/gpu-bundle/bundle.tar.xz)
echo "target/gpu-bundle/bundle.tar.xz: $((size >> 20)) MiB"
if [ $((size >> 20)) -ge "$limit_mib" ]; then
    echo "the bundle is over ${limit_mib} MiB: with the working tree it would not travel (64 MiB)" >&2
    exit 1
fi
