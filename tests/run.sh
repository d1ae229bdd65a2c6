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
# tests/tests/dashboard.rs; without it that test skips its browser checks and says so.
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
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --features wrk-tests/ucx -- -D warnings
cargo test --workspace --features wrk-tests/ucx --exclude taxi-haversine --exclude noop \
    --exclude test-guest-trap --exclude test-guest-spin --exclude test-guest-hog \
    --exclude test-guest-slow --exclude test-guest-memory
