# Sourced by tools/llama-wheel.sh and tools/llama-server.sh: the llama-cpp-python source both build
# from, patched with tools/llama-patches/, and the parts of their cache folders' names that say
# which build it is. Not a command.
#
# Sets VERSION (llama-cpp-python's, LLAMA_CPP_PYTHON or 0.3.36), CACHE ($DSR1D_WHEEL_CACHE or
# /var/cache/dsr1d-build), flags (the CPU's vector extensions, a+b+..., empty if none; read from
# $DSR1D_CPUINFO or /proc/cpuinfo), patches (the patch files: all of tools/llama-patches/*.patch, or
# only those DSR1D_LLAMA_PATCHES names), names (their names, space-separated) and patched (8 hex
# digits of a hash of names and contents, so a changed patch builds again); defines llama_source.
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
CACHE=${DSR1D_WHEEL_CACHE:-/var/cache/dsr1d-build}
cpu_flags=$(grep -m1 '^flags' "${DSR1D_CPUINFO:-/proc/cpuinfo}" | tr ' ' '\n')
flags=$(grep -xE 'avx|avx2|fma|f16c|avx_vnni|avx512f|avx512bw|avx512vl|avx512dq|avx512_vnni|avx512_bf16|avx512vbmi|amx_tile|amx_int8|amx_bf16' \
    <<<"$cpu_flags" | sort | paste -sd+ - || true)
_llama_patch_dir="$(dirname "${BASH_SOURCE[0]}")/llama-patches"
if [ -n "${DSR1D_LLAMA_PATCHES+x}" ]; then
    patches=()
    for name in $DSR1D_LLAMA_PATCHES; do
        patches+=("$_llama_patch_dir/$name.patch")
        [ -f "${patches[-1]}" ] || { echo "$(basename "$0"): no patch $name in tools/llama-patches/" >&2; exit 2; }
    done
else
    patches=("$_llama_patch_dir"/*.patch)
fi
names=$(for p in "${patches[@]}"; do basename "$p" .patch; done | paste -sd' ' -)
patched=$( (echo "$names"; for p in "${patches[@]}"; do cat "$p"; done) | sha256sum | cut -c1-8)

# llama_source PYTHON DIR: downloads the source distribution into DIR with PYTHON's pip, unpacks
# it there (DIR/llama_cpp_python-$VERSION), applies the patches in order from its root and writes
# their names into llama_dsr1d_patches() (build-marker.patch). Messages go to stderr; under set -e
# a failed step ends the caller (so call it as a command, not inside $(...)).
llama_source() {
    local python=$1 dir=$2 p
    "$python" -m pip download -q --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$dir" >&2
    tar -xzf "$dir/llama_cpp_python-$VERSION.tar.gz" -C "$dir"
    for p in "${patches[@]}"; do
        # --fuzz=0: a patch whose context moved fails here instead of landing in the wrong place
        patch -s -p1 --fuzz=0 --forward -d "$dir/llama_cpp_python-$VERSION" <"$p" >&2 \
            || { echo "$(basename "$p"): does not apply to llama-cpp-python $VERSION" >&2; return 1; }
    done
    sed -i "s/@DSR1D_PATCHES@/$names/" "$dir/llama_cpp_python-$VERSION/vendor/llama.cpp/src/llama.cpp"
}

# cmake_build WHO SRC BUILD TARGET CMAKE_ARG...: configures SRC into BUILD and builds TARGET only;
# the compiler's output (warnings from the vendored sources) goes to BUILD.log and is shown only
# when the build fails, with WHO's message (then it returns 1: under set -e the caller ends).
cmake_build() {
    local who=$1 src=$2 build=$3 target=$4
    shift 4
    if ! { cmake -S "$src" -B "$build" "$@" &&
           cmake --build "$build" --target "$target" -j"$(nproc)"; } >"$build.log" 2>&1; then
        tail -n 60 "$build.log" >&2
        echo "$who: the build failed (the end of its log above)" >&2
        return 1
    fi
}
