#!/usr/bin/env bash
# cuDF for the GPU machines lent to this project, which have no package index and take at most
# 64 MiB of files per call: the packages cuDF needs beyond what their image already has (CuPy,
# Numba, pyarrow and the CUDA 13 libraries are there; pandas 3.0.2, the one cuDF 26.10 supports, is
# carried in case the image's is older), unpacked here as pip would install them, without
# their C++ headers, packed with xz and cut into parts that travel one call each, to be put
# back together there.
#
#   host/gpu-wheels.sh fetch            # here: -> target/gpu-wheels/part-1 .. part-N
#   host/gpu-wheels.sh receive PART     # there, once per part, each call carrying that part
#                                       # (carry ["target/gpu-wheels/part-K"]); after the last
#                                       # one it unpacks them into /tmp/wrk-cudf
#   host/gpu-check.sh peers             # which finds /tmp/wrk-cudf/env.sh
#
# Each part is as large as a call can carry beside the working tree; the first leaves room for
# target/gpu-bundle/bundle.tar.xz too, so that it travels with the bundle. Parts are kept in
# /tmp/wrk-wheels between calls, so the machine must stay warm (30 s after a call) from the
# first part to the last. PYTHON_VERSION (3.12, the image's) and CUDF_VERSION choose the wheels;
# the packed archive is kept in target/gpu-wheels/ and reused while they are the same.
set -euo pipefail
cd "$(dirname "$0")/.."
received=/tmp/wrk-wheels
site=/tmp/wrk-cudf

case ${1:-} in
fetch)
    version=${CUDF_VERSION:-26.10.2}
    python=${PYTHON_VERSION:-3.12}
    dir=target/gpu-wheels
    archive=$dir/cudf-site.tar.xz
    stamp="cudf $version python $python pandas ${PANDAS_VERSION:-3.0.2}, nvCOMP as libcudf names it"
    if [ ! -f "$archive" ] || [ "$(cat "$dir/stamp" 2>/dev/null)" != "$stamp" ]; then
        rm -rf "$dir"
        mkdir -p "$dir/wheels" "$dir/site"
        platforms=()
        for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
            manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
            platforms+=(--platform "$p")
        done
        download() {
            python3 -m pip download -q --disable-pip-version-check --no-deps \
                --only-binary=:all: --python-version "$python" --implementation cp \
                "${platforms[@]}" -d "$dir/wheels" "$@"
        }
        download "libcudf-cu13==$version"
        # libcudf links one nvCOMP major (libnvcomp.so.5 for 26.10), which the newest nvCOMP
        # wheel need not be: take the version libcudf names.
        nvcomp=$(python3 - "$dir"/wheels/libcudf_cu13-*.whl <<'PY'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(metadata).decode().splitlines():
    if re.match(r"Requires-Dist: nvidia-libnvcomp-cu13\b", line) and "extra ==" not in line:
        print(line.split(":", 1)[1].strip().replace(" ", ""))
        break
PY
)
        download "cudf-cu13==$version" "pylibcudf-cu13==$version" "rmm-cu13==${version%.*}.*" \
            "librmm-cu13==${version%.*}.*" "libkvikio-cu13==${version%.*}.*" \
            "${nvcomp:-nvidia-libnvcomp-cu13}" "rapids-logger==0.3.*" nvtx cachetools \
            "pandas==${PANDAS_VERSION:-3.0.2}"
        # A wheel is a zip of what pip puts in site-packages (none of these has a .data folder
        # or scripts that matter here), and pip here would refuse another Python's wheels.
        for wheel in "$dir"/wheels/*.whl; do
            python3 -m zipfile -e "$wheel" "$dir/site"
        done
        if ls -d "$dir"/site/*.data >/dev/null 2>&1; then
            echo "gpu-wheels: a wheel has a .data folder, which unzipping does not install" >&2
            exit 1
        fi
        # Headers and tools are for building against these libraries, not for loading them.
        find "$dir/site" -type d \( -name include -o -name __pycache__ \) -prune -exec rm -rf {} +
        rm -rf "$dir/site/nvidia/libnvcomp/bin"
        tar -C "$dir/site" -cf - . | xz -T0 -9 >"$archive"
        rm -rf "$dir/wheels" "$dir/site"
        echo "$stamp" >"$dir/stamp"
    fi
    rm -rf "$dir"/part-*
    # What a call may carry, less a margin, less the working tree that travels with each call.
    call_bytes=$(((64 - 3) << 20))
    tree_bytes=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -n 1 |
        cut -f1)
    bundle_bytes=$(stat -c %s target/gpu-bundle/bundle.tar.xz 2>/dev/null || echo 0)
    size=$(stat -c %s "$archive")
    sum=$(sha256sum "$archive" | cut -d' ' -f1)
    offsets=()
    offset=0
    room=$((call_bytes - tree_bytes - bundle_bytes))
    while [ "$offset" -lt "$size" ]; do
        offsets+=("$offset")
        offset=$((offset + room))
        room=$((call_bytes - tree_bytes))
    done
    count=${#offsets[@]}
    for k in $(seq 1 "$count"); do
        start=${offsets[$((k - 1))]}
        if [ "$k" -lt "$count" ]; then
            length=$((${offsets[$k]} - start))
        else
            length=$((size - start))
        fi
        mkdir -p "$dir/part-$k"
        dd if="$archive" of="$dir/part-$k/piece" iflag=skip_bytes,count_bytes skip="$start" \
            count="$length" bs=4M status=none
        echo "$k $count $sum" >"$dir/part-$k/which"
    done
    sizes=$(du -b "$dir"/part-*/piece | awk '{printf "%d ", $1 / 1048576}')
    echo "$dir: $count parts (${sizes}MiB; the first leaves room for the bundle), sha256 $sum"
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
    cat "$received"/piece-* >"$received/cudf-site.tar.xz"
    echo "$sum  $received/cudf-site.tar.xz" | sha256sum -c --quiet
    rm -rf "$site"
    mkdir -p "$site"
    xz -T0 -dc "$received/cudf-site.tar.xz" | tar -C "$site" -xf -
    # The image's NumPy (2.5) has no numpy.row_stack, which a package that cuDF imports from
    # the image still reads; vstack is what it was an alias of.
    cat >"$site/sitecustomize.py" <<'PY'
import numpy

if not hasattr(numpy, "row_stack"):
    numpy.row_stack = numpy.vstack
PY
    # What a process that imports cuDF needs: the packages, and the libraries beside them (the
    # wheels load them themselves; this is for a library one of them links by name).
    libraries=$(find "$site" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)
    cat >"$site/env.sh" <<EOF
export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}
export LD_LIBRARY_PATH=$libraries\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
EOF
    . "$site/env.sh"
    python3 -c '
import cudf, pandas, pyarrow, numba, cupy
print("gpu-wheels: cuDF", cudf.__version__, "ready in '"$site"' (pandas", pandas.__version__,
      "pyarrow", pyarrow.__version__, "numba", numba.__version__, "cupy", cupy.__version__ + ")")'
    ;;
*)
    echo "usage: host/gpu-wheels.sh fetch | receive PART" >&2
    exit 2
    ;;
esac
