"""dsr1d's K-quant kernels (tools/llama-patches/kquant-vnni.patch) answer as the release's do.

On a CPU with AVX2 (AVX-512 VNNI where it has it), Q4_K, Q5_K, Q6_K and IQ4_XS matrices (and Q4_0,
IQ4_NL and Q8_0 where there is no AMX, whose tiles take them otherwise) are repacked at load into
the ``CPU_DSR1D_KQ`` buffer and multiplied by dsr1d's kernels; ``DSR1D_KQUANTS=avx2`` runs the
kernels and types an AVX2-only CPU gets on a CPU with AVX-512 too, so that every CI machine checks
both kernel sets; ``DSR1D_KQUANTS=0`` turns them off, which leaves
llama.cpp's own kernels (the release's; Q4_0, IQ4_NL and Q8_0 through amx/'s VNNI rows, which sum
as the release's do). Both quantize the activations the same way (Q8_K; per 32 for the rest), so
the logits may differ only by the order of float sums. Checked on SmolLM2-135M-Instruct
requantized from its file to each type (its 576-wide matrices cannot be K-quants: llama-quantize
keeps them in a fallback type, so its ffn_down are the K-quant products) with the perplexity of a
shipped text, and on a random model of R1's vocabulary where every matrix is of the type (int4:
dsr1d's own conversion, Q4_0 with an IQ4_NL output), at one,
seven and 64 tokens a batch (the one-row, the four-row plus remainder and the prompt paths;
llama.cpp takes its tiled K-quant path from eight rows, which sums in another order).
``DSR1D_KQUANTS=all`` puts Q4_0, IQ4_NL and Q8_0 in the kernels' buffer on an AMX CPU too (for
measuring them against amx/'s tiles), where the same logits are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsr1d.cpu import cpu_flags
from engine_fixtures import smollm2  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "src" / "dsr1d" / "engine" / "corpus.txt"
HAS_KERNELS = {"avx2", "fma", "f16c"} <= cpu_flags()
TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q8_0", "Q4_0"]
RANDOM_TYPES = TYPES + ["int4"]
# the matrix types the kernels take: the K-quants everywhere, those with a d per 32 columns only
# where there is no AMX (its tiles keep them)
K_TYPES = {"Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
PER32 = {"Q4_0", "IQ4_NL", "Q8_0"}
# the loader's line for the buffer's weights (its name alone is also in a line saying which
# tensors it could not take)
BUFFER = "CPU_DSR1D_KQ model buffer size"

# loads the file with llama-cpp-python (dsr1d's build), evaluates the ids n_batch at a time with
# every position's logits kept, saves them, and prints the log (where the buffers are named)
EVAL = """
import json, sys
import numpy as np
import llama_cpp
path, ids, n_batch, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = llama_cpp.Llama(model_path=path, n_ctx=max(128, len(ids)), n_batch=n_batch,
                      n_ubatch=n_batch, n_threads=2, logits_all=True, verbose=True)
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
"""

QUANTIZE = """
import sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.allow_requantize = True
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def _run(code: str, *args: str, kernels: str = "1") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DSR1D_KQUANTS=kernels)
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _logits(path: Path, ids: list[int], n_batch: int, kernels: str, tmp: Path) -> tuple[np.ndarray, str]:
    out = tmp / f"logits-{kernels}-{n_batch}.npy"
    proc = _run(EVAL, str(path), json.dumps(ids), str(n_batch), str(out), kernels=kernels)
    return np.load(out), proc.stderr


def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    z = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def _tokens(path: Path, n: int) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llm.tokenize(CORPUS.read_text(encoding="utf-8").encode(), add_bos=True)[:n]


@pytest.fixture(scope="module")
def requantized(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    out = tmp_path_factory.mktemp("kquants")
    files = {}
    for ftype in TYPES:
        files[ftype] = out / f"smollm2-{ftype}.gguf"
        _run(QUANTIZE, str(smollm2), str(files[ftype]), ftype)
    return files


@pytest.fixture(scope="module")
def random_r1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "bench"))
    import random_gguf

    out = tmp_path_factory.mktemp("random-kquants")
    files = {}
    for ftype in RANDOM_TYPES:
        files[ftype] = out / f"draft-{ftype}.gguf"
        random_gguf.write("draft", ftype, files[ftype])
    return files


def _matrix_types(path: Path) -> set[str]:
    from gguf import GGUFReader

    # the embedding is read by rows, never multiplied in a kernel's buffer
    return {t.tensor_type.name for t in GGUFReader(path).tensors
            if len(t.shape) == 2 and t.name != "token_embd.weight"}


def _check_buffer(log_on: str, log_off: str, path: Path, setting: str = "1") -> None:
    # the kernels are in use exactly where the CPU has them and the file has a type they take
    # (a Q4_0 file's Q6_K output on AMX), and never with DSR1D_KQUANTS=0
    amx_keeps_per32 = "amx_int8" in cpu_flags() and setting not in ("all", "avx2")
    taken = K_TYPES | (set() if amx_keeps_per32 else PER32)
    expected = HAS_KERNELS and bool(_matrix_types(path) & taken)
    assert (BUFFER in log_on) == expected, log_on[-2000:]
    assert BUFFER not in log_off
    if expected:   # and the kernel set the setting asks for
        wide = {"avx512_vnni", "avx512bw"} <= cpu_flags() and setting != "avx2"
        assert f"dsr1d's {'AVX-512 VNNI' if wide else 'AVX2'} kernels" in log_on, log_on[-2000:]


@pytest.mark.parametrize("setting", ["1", "avx2"])
@pytest.mark.parametrize("ftype", TYPES)
def test_smollm2_perplexity_matches_the_release_kernels(ftype: str, setting: str,
                                                        requantized: dict[str, Path],
                                                        tmp_path: Path) -> None:
    path = requantized[ftype]
    ids = _tokens(path, 256)
    on, log_on = _logits(path, ids, 64, setting, tmp_path)
    off, log_off = _logits(path, ids, 64, "0", tmp_path)
    _check_buffer(log_on, log_off, path, setting)
    ppl_on, ppl_off = _perplexity(on, ids), _perplexity(off, ids)
    assert abs(ppl_on / ppl_off - 1) < 0.005, (ppl_on, ppl_off)
    # The activations are requantized at every layer, so float order alone moves a rounding here
    # and there (the release's own two K-quant paths differ as much); a wrong scale, min or bit
    # turns the model's top token into noise.
    assert (on.argmax(axis=1) == off.argmax(axis=1)).mean() >= 0.9


# DSR1D_KQUANTS=all: the kernels take Q4_0, IQ4_NL and Q8_0 even where amx/ would (to measure one
# against the other on an AMX CPU); elsewhere it is the default. avx2: the AVX2 kernels, and the
# types an AVX2-only CPU gives them, where the CPU has AVX-512 too (elsewhere the default)
CASES = ([(t, "1") for t in RANDOM_TYPES] + [(t, "all") for t in ("Q4_0", "Q8_0", "int4")]
         + [(t, "avx2") for t in RANDOM_TYPES])


@pytest.mark.parametrize("n_batch", [1, 7, 64])
@pytest.mark.parametrize("ftype,setting", CASES)
def test_every_matrix_a_k_quant_gives_the_release_logits(ftype: str, setting: str, n_batch: int,
                                                        random_r1: dict[str, Path],
                                                        tmp_path: Path) -> None:
    path = random_r1[ftype]
    ids = list(range(10, 10 + (12 if n_batch == 1 else 64)))
    on, log_on = _logits(path, ids, n_batch, setting, tmp_path)
    off, log_off = _logits(path, ids, n_batch, "0", tmp_path)
    _check_buffer(log_on, log_off, path, setting)
    _assert_release_logits(on, off, ftype, n_batch)


def _assert_release_logits(on: np.ndarray, off: np.ndarray, ftype: str, n_batch: int) -> None:
    assert np.isfinite(off).all()
    # one row at a time both sides sum the K-quants alike (equal to 1 % of the spread); in
    # batches of 8+ the release takes its tiled path, and its Q8_0 kernel turns 8 partial sums of
    # each block into floats where dsr1d's turns the block's exact sum: float order moves a few
    # activation roundings, and the differences stay a few hundredths of the spread, where a
    # wrong scale, min or bit is the spread itself
    rms = float(np.sqrt(np.mean((on - off) ** 2)))
    alike = n_batch == 1 and ftype != "Q8_0"
    assert rms < (0.01 if alike else 0.03) * off.std(), rms
    assert (on.argmax(axis=1) == off.argmax(axis=1)).mean() >= 0.9
