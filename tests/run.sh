#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh machine, then runs every test of the
# workspace (unit tests next to the code, cross-crate and multi-process tests in tests/).
set -euo pipefail
cd "$(dirname "$0")/.."
# The guests build for wasm32-wasip2 (rust-toolchain.toml pins the toolchain and names the target;
# this makes sure the target is there even where rustup did not add it).
rustup target add wasm32-wasip2 >/dev/null
# promtool (Debian's prometheus package) checks the metrics exposition.
if ! command -v promtool >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# Headless Chromium (Debian's chromium package) renders the dashboard and a report in
# tests/tests/integration/dashboard.rs; without it that test skips its browser checks and says so.
if ! command -v chromium >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
        echo "tests/run.sh: could not install chromium; the dashboard test will skip its browser checks" >&2
    fi
fi
# UCX (Debian's libucx-dev, with libclang-dev for bindgen) builds the UCX shuffle transport, which
# the shuffle tests run over besides TCP.
if ! pkg-config --exists ucx 2>/dev/null || ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends libucx-dev libclang-dev pkg-config >/dev/null
fi
# A C++ compiler: the CUDA emulator compiles the GPU kernels for the host, so the GPU backend's
# tests run (against the CPU backend) on machines without a GPU.
if ! command -v c++ >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi
# NVRTC (CUDA's run-time compiler) from the nvidia-cuda-nvrtc-cu12 wheel, in a virtualenv under
# target/ (host/nvrtc-wheel.sh): the kernel tests compile every CUDA kernel to PTX with it, no
# GPU or CUDA toolkit needed. Without PyPI those tests print a skip line instead.
if nvrtc_lib=$(host/nvrtc-wheel.sh); then
    export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    echo "tests/run.sh: the PTX tests will print skip lines" >&2
fi
# moto (a local server speaking the S3 API) from PyPI, in a virtualenv under target/: the object
# store test reads a job's source from a bucket there. Without PyPI that test prints a skip line.
S3_VENV=target/s3-venv
if [ ! -x "$S3_VENV/bin/moto_server" ]; then
    python3 -m venv "$S3_VENV" >/dev/null 2>&1 || true
    if ! timeout 600 "$S3_VENV/bin/pip" install -q --disable-pip-version-check \
        "moto[server]==5.2.5" >/dev/null 2>&1; then
        echo "tests/run.sh: could not install moto from PyPI; the object store test will print a skip line" >&2
    fi
fi
# Earlier builds' artifacts pile up in target/debug (each change of dependencies or features leaves
# a new set beside the old) until the disk fills. With less than 10 GiB free, start afresh (a
# fresh build of everything here takes about 4 GiB; see the profiles in Cargo.toml).
read -r free_gib mount < <(df -P -B1G . | awk 'NR == 2 { print $4, $6 }')
if [ -d target/debug ] && [ "$free_gib" -lt 10 ]; then
    echo "tests/run.sh: only ${free_gib} GiB free on ${mount}; removing target/debug to build afresh" >&2
    rm -rf target/debug
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --features wrk-tests/ucx -- -D warnings
cargo test --workspace --features wrk-tests/ucx --exclude taxi-haversine --exclude noop \
    --exclude test-guest-trap --exclude test-guest-spin --exclude test-guest-hog \
    --exclude test-guest-slow --exclude test-guest-memory
