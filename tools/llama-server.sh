#!/usr/bin/env bash
# Builds llama-server for this CPU's instruction set, once, from the same patched llama.cpp that
# tools/llama-wheel.sh builds llama-cpp-python from (the llama-cpp-python source distribution,
# vendor/llama.cpp, with tools/llama-patches/*.patch applied: tools/llama-source.sh), and prints
# the path of the binary.
#
# Cached like the wheel in $DSR1D_WHEEL_CACHE (default /var/cache/dsr1d-build), in a folder named
# llama-server-VERSION-MACHINE-FLAGS-pHASH after the CPU's vector extensions (GGML_NATIVE=ON: a
# build with AVX-512 dies of SIGILL on an AVX2-only CPU) and a hash of the patches, holding
# llama-server (stripped) and version.txt (its --version). ggml and llama are linked in statically
# (BUILD_SHARED_LIBS=OFF): the binary needs only the C/C++ runtime and libgomp, so it can be copied
# to another machine with the same CPU flags. A cold build took 5 min 25 s here on 2 quiet cores
# (the download, the patches, and cmake --target llama-server, which compiles ggml, llama, common,
# mtmd and the server; 7 to 9 min with tests running on the machine at the same time); later
# set-ups on the same kind of CPU find it at once.
#
# Offline and lean: no tests, examples or other tools, no libcurl or OpenSSL (dsr1d serves on a
# unix socket: --host PATH.sock), and no web UI: LLAMA_BUILD_UI=OFF (no npm) and
# LLAMA_USE_PREBUILT_UI=OFF (no download of the prebuilt assets), so the server embeds an empty UI.
#
# Usage: tools/llama-server.sh [PYTHON]   (the Python whose pip downloads the source; python3)
# (DSR1D_CPUINFO: another /proc/cpuinfo to read; DSR1D_WHEEL_DRY_RUN=1: print the binary's path and
# the CMake arguments, build nothing; DSR1D_LLAMA_PATCHES="amx-tile-config": apply only these
# patches, as bench/serving.py builds the release's server)
set -euo pipefail
PYTHON=${1:-python3}
# VERSION, CACHE, flags, patches, names, patched; llama_source (shared with tools/llama-wheel.sh)
. "$(dirname "$0")/llama-source.sh"
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
dir="$CACHE/llama-server-$VERSION-$(uname -m)-${flags:-generic}-p$patched"
if [ -n "${DSR1D_WHEEL_DRY_RUN:-}" ]; then
    printf '%s\n%s\n' "$dir/llama-server" "${cmake_args[*]}"
    exit 0
fi
if ! [ -x "$dir/llama-server" ]; then
    echo "dsr1d set-up: building llama-server (llama-cpp-python $VERSION's llama.cpp) for this CPU (${flags:-no vector extensions}); about 6 minutes on 2 cores, once" >&2
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    llama_source "$PYTHON" "$tmp/src"
    cmake_build llama-server.sh "$tmp/src/llama_cpp_python-$VERSION/vendor/llama.cpp" "$tmp/build" \
        llama-server "${cmake_args[@]}"
    cp "$tmp/build/bin/llama-server" "$tmp/llama-server"
    strip "$tmp/llama-server"
    "$tmp/llama-server" --version >"$tmp/version.txt" 2>&1
    rm -rf "$tmp/src" "$tmp/build" "$tmp/build.log"
    chmod 755 "$tmp"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    trap - EXIT
fi
echo "$dir/llama-server"
