#!/usr/bin/env bash
# Builds what bench/server_scale.py needs on a lent many-core machine, here, into DIR: llama-bench
# from the release (only amx-tile-config, without which it dies on an AMX CPU) and from dsr1d's
# patched tree, each gzipped, and the gguf wheel the random-file writer imports. The lent machine
# has no compiler for this tree's purpose and little time: it only unpacks and measures.
#
# The binaries are built for DSR1D_KIT_ARCH (GCC's -march; default sapphirerapids, the 16-core AMX
# machines the engine issue measures on; "native" for this machine), not for this CPU: the
# compiler emits AMX and AVX512-FP16 code this machine may not be able to run. Static ggml and
# llama (BUILD_SHARED_LIBS=OFF), so each needs only the C/C++ runtime and libgomp. About 4 minutes
# a binary on 2 cores.
#
# With DSR1D_IK_SOURCE=TREE (an ik_llama.cpp checkout, as tools/ik-llama-server.sh takes), the kit
# holds ik_llama.cpp's llama-bench too (about 15 minutes more).
#
# Usage: tools/server-scale-kit.sh DIR [PYTHON]
#   then, on the lent machine: see bench/server_scale.py
set -euo pipefail
OUT=${1:?usage: tools/server-scale-kit.sh DIR [PYTHON]}
PYTHON=${2:-python3}
ARCH=${DSR1D_KIT_ARCH:-sapphirerapids}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# build ROW PATCHES: llama-bench from the source with only PATCHES ("" = all) into OUT/ROW-llama-bench.gz
# (not $name: llama-source.sh loops over the patch names with it)
build() {
    local row=$1 tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    (   # a subshell: the patch selection and llama-source.sh's variables stay in it
        if [ -n "$2" ]; then export DSR1D_LLAMA_PATCHES=$2; else unset DSR1D_LLAMA_PATCHES; fi
        # VERSION, patches, names, llama_source, cmake_build
        . "$HERE/llama-source.sh"
        echo "server-scale kit: $row llama-bench for -march=$ARCH ($names)" >&2
        llama_source "$PYTHON" "$tmp/src"
        cmake_build "server-scale-kit.sh ($row)" "$tmp/src/llama_cpp_python-$VERSION/vendor/llama.cpp" \
            "$tmp/build" llama-bench -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
            -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="-march=$ARCH" -DCMAKE_CXX_FLAGS="-march=$ARCH" \
            -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF
        strip "$tmp/build/bin/llama-bench"
        gzip -9c "$tmp/build/bin/llama-bench" >"$OUT/$row-llama-bench.gz"
        echo "$names" >"$OUT/$row-patches.txt"
    )
    rm -rf "$tmp"
    trap - EXIT
}

# build_ik: ik_llama.cpp's llama-bench from the tree in DSR1D_IK_SOURCE (as tools/ik-llama-server.sh
# takes it) into OUT/ik-llama-bench.gz; its run-time repack is a flag of the run (-rtr 1)
build_ik() {
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "server-scale kit: ik_llama.cpp's llama-bench for -march=$ARCH from $DSR1D_IK_SOURCE" >&2
    cp -a "$DSR1D_IK_SOURCE" "$tmp/src"
    (
        . "$HERE/llama-source.sh"
        cmake_build "server-scale-kit.sh (ik)" "$tmp/src" "$tmp/build" llama-bench \
            -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
            -DCMAKE_C_FLAGS="-march=$ARCH" -DCMAKE_CXX_FLAGS="-march=$ARCH" -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF
    )
    strip "$tmp/build/bin/llama-bench"
    gzip -9c "$tmp/build/bin/llama-bench" >"$OUT/ik-llama-bench.gz"
    rm -rf "$tmp"
    trap - EXIT
}

build release amx-tile-config
build dsr1d ""
if [ -n "${DSR1D_IK_SOURCE:-}" ]; then
    build_ik
fi
echo "$ARCH" >"$OUT/arch.txt"
# the writer's one import the lent machine lacks, at the version this checkout's set-up installs
version=$("$HERE/../.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("gguf"))' 2>/dev/null || echo 0.19.0)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: "gguf==$version" -d "$OUT"
ls -l "$OUT" >&2
