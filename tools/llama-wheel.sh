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
# does; the cache folder carries a hash of them, so a changed patch builds again; the download and
# the patching are tools/llama-source.sh, shared with tools/llama-server.sh):
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
# - kv-fresh-zero.patch: CPU buffers of 2 MiB or more are anonymous mappings, cleared to zero by
#   giving their pages back, so a KV cache takes memory as it fills instead of all of it at load
#   (llama-server, 16k context and 4 slots of SmolLM2-135M: 528 -> 171 MB resident after load).
# - lazy-embeddings.patch: the R1 distills' embedding table (qwen2, llama) stays in the file and
#   is read row by row when the caller sets lazy_mode ON, as dsr1d's worker does; a decoded token
#   reads one row of it, so loading all of it (237 MiB for the 1.5B in Q8_0, 0.5 GiB for the
#   8B) only cost memory. Callers that keep llama.cpp's default (AUTO) load it as before.
# - plain-message-text.patch: llama-server's chat endpoints tokenize the messages' text with special
#   tokens not parsed (only the template's markup is), so text cannot forge chat turns; and the
#   tokenizer's special-token split is linear in the matches instead of quadratic.
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
arch="-DGGML_NATIVE=ON"
pytag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# VERSION, CACHE, flags, patches, names, patched; llama_source (shared with tools/llama-server.sh)
. "$(dirname "$0")/llama-source.sh"
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
    llama_source "$PYTHON" "$tmp/src"
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
