#!/usr/bin/env bash
# Builds llama-cpp-python from its source distribution for this CPU's instruction set, once, and
# prints the folder that holds the wheel (for `pip install --find-links`).
#
# The wheel is cached in $DSR1D_WHEEL_CACHE (default /var/cache/dsr1d-build) under a folder
# named after the machine, the Python and the CPU's vector extensions it was built for
# (GGML_NATIVE=ON compiles for the host: a wheel built with AVX-512 would die of SIGILL on an
# AVX2-only CPU, so each set of flags gets its own build). A later set-up on the same kind of CPU
# installs in seconds; a cold build takes about 4 minutes on 2 quiet cores (measured; 15 with the
# multimodal library and other work on the machine). The multimodal library (LLAVA_BUILD) is left
# out: R1 reads text only.
#
# Usage: tools/llama-wheel.sh PYTHON
set -euo pipefail
PYTHON=${1:-python3}
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
CACHE=${DSR1D_WHEEL_CACHE:-/var/cache/dsr1d-build}
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
    grep -xE 'avx|avx2|fma|f16c|avx_vnni|avx512f|avx512bw|avx512vl|avx512dq|avx512_vnni|avx512_bf16|avx512vbmi|amx_tile|amx_int8|amx_bf16' |
    sort | paste -sd+ -)
pytag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
dir="$CACHE/llama-cpp-python-$VERSION-$(uname -m)-$pytag-${flags:-generic}"
if ! ls "$dir"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "dsr1d set-up: building llama-cpp-python $VERSION for this CPU (${flags:-no vector extensions}); about 4 minutes on 2 cores, once" >&2
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PYTHON" -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -w "$tmp" >&2
    chmod 755 "$tmp"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    trap - EXIT
fi
echo "$dir"
