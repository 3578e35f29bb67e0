#!/usr/bin/env bash
# Builds ik_llama.cpp's llama-server for this CPU, once, as a peer for bench/inference.py, and
# prints the path of the binary. Built the way tools/llama-server.sh builds dsr1d's and the
# release's (GGML_NATIVE=ON, static, Release, no curl), so the three differ only in their sources.
#
# The source is ik_llama.cpp at $DSR1D_IK_COMMIT (default the commit issue 27 measured), cloned
# from $DSR1D_IK_REPO (default GitHub), or the tree in $DSR1D_IK_SOURCE (a local checkout: no
# network). Cached in $DSR1D_WHEEL_CACHE (default /var/cache/dsr1d-build) in a folder named
# ik-llama-server-COMMIT-MACHINE-FLAGS after the CPU's vector extensions. A cold build takes about
# 15 minutes on 2 cores (its iqk kernels are large); the bench calls this before it times anything.
#
# Usage: tools/ik-llama-server.sh
set -euo pipefail
. "$(dirname "$0")/llama-source.sh"
COMMIT=${DSR1D_IK_COMMIT:-8337e4cd3861406fc04e0854b1409cd1b027fbc9}
REPO=${DSR1D_IK_REPO:-https://github.com/ikawrakow/ik_llama.cpp}
dir="$CACHE/ik-llama-server-${COMMIT:0:12}-$(uname -m)-${flags:-generic}"
if ! [ -x "$dir/llama-server" ]; then
    echo "dsr1d bench: building ik_llama.cpp's llama-server (${COMMIT:0:12}) for this CPU; about 15 minutes on 2 cores, once" >&2
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    if [ -n "${DSR1D_IK_SOURCE:-}" ]; then
        cp -a "$DSR1D_IK_SOURCE" "$tmp/src"
    else
        git init -q "$tmp/src"
        git -C "$tmp/src" fetch -q --depth 1 "$REPO" "$COMMIT"
        git -C "$tmp/src" checkout -q FETCH_HEAD
    fi
    # a partial mirror may lack the web UI's assets; the bench never loads the UI, so empty ones do
    for asset in public/index.html.gz public_llamacpp/index_llamacpp.html.gz public_llamacpp/loading.html; do
        [ -e "$tmp/src/examples/server/$asset" ] || { mkdir -p "$(dirname "$tmp/src/examples/server/$asset")"; : >"$tmp/src/examples/server/$asset"; }
    done
    cmake_build ik-llama-server.sh "$tmp/src" "$tmp/build" llama-server -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
    cp "$tmp/build/bin/llama-server" "$tmp/llama-server"
    strip "$tmp/llama-server"
    rm -rf "$tmp/src" "$tmp/build" "$tmp/build.log"
    chmod 755 "$tmp"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    trap - EXIT
fi
echo "$dir/llama-server"
