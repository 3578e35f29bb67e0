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
# The source is patched before the build with tools/llama-patches/*.patch (each says what it
# does; the cache folder carries a hash of them, so a changed patch builds again):
# - amx-tile-config.patch: llama.cpp's AMX int8 kernels (Q4_0/Q8_0/K-quant weights on CPUs with
#   amx_int8, Sapphire Rapids and later) crashed with SIGSEGV on the first batch of two or more
#   tokens (llama.cpp #20824): GCC 12 at -O3 drops the tile configuration's stores before
#   ldtilecfg, which then faults on the garbage. A compiler barrier keeps them, and the
#   configuration is loaded for every product (torch's oneDNN releases the tiles in the same
#   process: SIGILL otherwise). AMX then prefills 2-3x and decodes ~1.4x faster on such a CPU.
# - amx-vnni-rows.patch: on an AMX CPU a Q4_0 or Q8_0 product of 2-8 rows (a decoding batch) goes
#   through the VNNI kernel, four rows at a time, instead of 16-row AMX tiles (a 4-row step of
#   the 1.5B 69 -> 45 ms), and IQ4_NL (the int4 files' output matrix) gets AMX buffers and this
#   kernel instead of AVX2 kernels (11.8 -> 4.3 ms a token); same logits, alone or in a batch.
#   On AVX-512 VNNI CPUs without AMX (Zen 4) these types take the same kernels for every product
#   (measured with a no-AMX build: a Q4_0 step 48.5 -> 29.1 ms, four rows 75.7 -> 38.6 ms).
# - bf16-packed.patch: BF16 weights (CPUs with AVX512_BF16) packed at load for vdpbf16ps and
#   AMX-BF16 tiles, each thread streaming one run of weights with a software prefetch: a one-row
#   step of the 1.5B 140 -> 100 ms, a 128-token prompt (AMX-BF16) 2.3 -> 0.7 s.
# - build-marker.patch: llama_dsr1d_patches() names the patches, so dsr1d tells its own build.
# - lazy-embeddings.patch: the R1 distills' embedding table (qwen2, llama) stays in the file and
#   is read row by row when the caller sets lazy_mode ON, as dsr1d's worker does; a decoded token
#   reads one row of it, so loading all of it (237 MiB for the 1.5B in Q8_0, 0.5 GiB for the
#   8B) only cost memory. Callers that keep llama.cpp's default (AUTO) load it as before.
# - q8-signed-vnni.patch: Q8_0 weights packed without the 64 bytes per 544 llama.cpp stored for
#   its VNNI kernel's compensation (11 % fewer bytes to read; the same integer sums, the same
#   logits): a 2-row step of the 1.5B 59.0 -> 54.6 ms, a 128-token prompt 1.01 -> 0.60 s.
# - vnni-prefetch.patch: the VNNI kernels that decode Q4_0, Q8_0 and IQ4_NL ask for each weight
#   stream's bytes 2 KiB ahead into L2: a one-row step of the 1.5B in Q8_0 54.1 -> 50.0 ms, Q4_0
#   28.7 -> 27.4 ms.
#
# Usage: tools/llama-wheel.sh PYTHON
# (DSR1D_CPUINFO: another /proc/cpuinfo to read; DSR1D_WHEEL_DRY_RUN=1: print the folder and the
# CMake arguments, build nothing — for the tests; DSR1D_LLAMA_PATCHES="amx-tile-config": apply
# only these patches — bench/inference.py builds llama.cpp as released that way, with only the
# fix it needs to run on an AMX CPU, for its "stock" rows)
set -euo pipefail
PYTHON=${1:-python3}
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
CACHE=${DSR1D_WHEEL_CACHE:-/var/cache/dsr1d-build}
cpu_flags=$(grep -m1 '^flags' "${DSR1D_CPUINFO:-/proc/cpuinfo}" | tr ' ' '\n')
flags=$(grep -xE 'avx|avx2|fma|f16c|avx_vnni|avx512f|avx512bw|avx512vl|avx512dq|avx512_vnni|avx512_bf16|avx512vbmi|amx_tile|amx_int8|amx_bf16' \
    <<<"$cpu_flags" | sort | paste -sd+ - || true)
arch="-DGGML_NATIVE=ON"
pytag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ -n "${DSR1D_LLAMA_PATCHES+x}" ]; then
    patches=()
    for name in $DSR1D_LLAMA_PATCHES; do
        patches+=("$(dirname "$0")/llama-patches/$name.patch")
        [ -f "${patches[-1]}" ] || { echo "llama-wheel.sh: no patch $name in tools/llama-patches/" >&2; exit 2; }
    done
else
    patches=("$(dirname "$0")"/llama-patches/*.patch)
fi
names=$(for p in "${patches[@]}"; do basename "$p" .patch; done | paste -sd' ' -)
patched=$( (echo "$names"; for p in "${patches[@]}"; do cat "$p"; done) | sha256sum | cut -c1-8)
dir="$CACHE/llama-cpp-python-$VERSION-$(uname -m)-$pytag-${flags:-generic}-p$patched"
if [ -n "${DSR1D_WHEEL_DRY_RUN:-}" ]; then
    printf '%s\n%s\n' "$dir" "$arch"
    exit 0
fi
if ! ls "$dir"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "dsr1d set-up: building llama-cpp-python $VERSION for this CPU (${flags:-no vector extensions}); about 4 minutes on 2 cores, once" >&2
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$tmp/src" >&2
    tar -xzf "$tmp/src/llama_cpp_python-$VERSION.tar.gz" -C "$tmp/src"
    for p in "${patches[@]}"; do
        patch -s -p1 -d "$tmp/src/llama_cpp_python-$VERSION" <"$p" >&2
    done
    sed -i "s/@DSR1D_PATCHES@/$names/" "$tmp/src/llama_cpp_python-$VERSION/vendor/llama.cpp/src/llama.cpp"
    CMAKE_ARGS="$arch -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PYTHON" -m pip wheel -q --no-deps --no-cache-dir "$tmp/src/llama_cpp_python-$VERSION" \
        -w "$tmp" >&2
    rm -rf "$tmp/src"
    chmod 755 "$tmp"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    trap - EXIT
fi
echo "$dir"
