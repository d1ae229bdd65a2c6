#!/usr/bin/env bash
# cuDF for the GPU machines lent to this project, which have no package index and take at most
# 64 MiB of files per call: the wheels cuDF needs beyond what their image already has (CuPy,
# Numba, pandas, pyarrow and the CUDA 13 libraries are there), cut into parts that travel one
# call each, and put back together there.
#
#   host/gpu-wheels.sh fetch            # here: -> target/gpu-wheels/part-1 .. part-N
#   host/gpu-wheels.sh receive PART     # there, once per part, each call carrying that part
#                                       # (carry ["target/gpu-wheels/part-K"]); after the last
#                                       # one it installs them into /tmp/wrk-cudf
#   PYTHONPATH=/tmp/wrk-cudf host/gpu-check.sh peers
#
# Parts are kept in /tmp/wrk-wheels between calls, so the machine must stay warm (30 s after a
# call) from the first part to the last. PYTHON_VERSION (3.12, the image's) and CUDF_VERSION
# choose the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
part_bytes=$((59 << 20))
received=/tmp/wrk-wheels
site=/tmp/wrk-cudf

case ${1:-} in
fetch)
    version=${CUDF_VERSION:-26.10.2}
    rm -rf target/gpu-wheels
    mkdir -p target/gpu-wheels/wheels
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
        manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "${PYTHON_VERSION:-3.12}" --implementation cp "${platforms[@]}" \
        -d target/gpu-wheels/wheels "cudf-cu13==$version" "pylibcudf-cu13==$version" \
        "libcudf-cu13==$version" "rmm-cu13==${version%.*}.*" "librmm-cu13==${version%.*}.*" \
        "libkvikio-cu13==${version%.*}.*" nvidia-libnvcomp-cu13 rapids-logger nvtx cachetools
    tar -C target/gpu-wheels/wheels -cf target/gpu-wheels/wheels.tar .
    rm -rf target/gpu-wheels/wheels
    (cd target/gpu-wheels && split -b "$part_bytes" -d -a 2 wheels.tar piece-)
    count=$(ls target/gpu-wheels/piece-* | wc -l)
    sum=$(sha256sum target/gpu-wheels/wheels.tar | cut -d' ' -f1)
    k=0
    for piece in target/gpu-wheels/piece-*; do
        k=$((k + 1))
        mkdir -p "target/gpu-wheels/part-$k"
        mv "$piece" "target/gpu-wheels/part-$k/piece"
        echo "$k $count $sum" >"target/gpu-wheels/part-$k/which"
    done
    rm target/gpu-wheels/wheels.tar
    echo "target/gpu-wheels: $count parts of at most $((part_bytes >> 20)) MiB (sha256 $sum)"
    ;;
receive)
    k=${2:?which part}
    dir=target/gpu-wheels/part-$k
    read -r index count sum <"$dir/which"
    mkdir -p "$received"
    cp "$dir/piece" "$received/piece-$(printf %02d "$index")"
    have=$(ls "$received"/piece-* | wc -l)
    echo "gpu-wheels: part $index of $count here ($have received)"
    if [ "$have" -lt "$count" ]; then
        exit 0
    fi
    cat "$received"/piece-* >"$received/wheels.tar"
    echo "$sum  $received/wheels.tar" | sha256sum -c --quiet
    mkdir -p "$received/wheels"
    tar -C "$received/wheels" -xf "$received/wheels.tar"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$received"/wheels/*.whl
    PYTHONPATH=$site python3 -c 'import cudf; print("gpu-wheels: cuDF", cudf.__version__, "ready in '"$site"'")'
    ;;
*)
    echo "usage: host/gpu-wheels.sh fetch | receive PART" >&2
    exit 2
    ;;
esac
