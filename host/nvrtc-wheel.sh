#!/usr/bin/env bash
# NVRTC (CUDA's run-time compiler) from the nvidia-cuda-nvrtc-cu12 wheel, in a virtualenv under
# target/nvrtc-venv: prints the folder holding libnvrtc.so.12, installing the wheel first where
# it is missing (from PyPI). Exits 1, saying why, where it cannot. Used by tests/run.sh (the
# PTX tests), host/gpu-check.sh and host/gpu-bundle.sh, so all three use the one version.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=target/nvrtc-venv
lib() { ls -d "$PWD/$venv"/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib 2>/dev/null | head -n 1; }
if [ -z "$(lib)" ] || [ ! -e "$(lib)/libnvrtc.so.12" ]; then
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        # Debian splits venv support out of python3.
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv >/dev/null; } || true
        python3 -m venv "$venv" >/dev/null 2>&1 || true
    fi
    if ! timeout 600 "$venv/bin/pip" install -q --disable-pip-version-check \
        "nvidia-cuda-nvrtc-cu12==12.9.86" >/dev/null 2>&1; then
        echo "could not install nvidia-cuda-nvrtc-cu12 from PyPI into $venv" >&2
        exit 1
    fi
fi
lib
