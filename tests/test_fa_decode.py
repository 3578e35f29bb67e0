"""dsr1d's flash-attention decode (tools/llama-patches/fa-decode-gqa.patch) answers as llama.cpp's.

With flash attention on, the tokens llama.cpp's tiled path does not take (one token, batches of
fewer than 64 such as a speculative batch or a few streams' step, any batch over a Q8_0 cache)
take dsr1d's grouped path: the query heads of one KV head read each K and V row together, a block
at a time, with F32 accumulators. ``DSR1D_FA_DECODE=0`` leaves it to llama.cpp's per-head loop
(F16 accumulators). Rounding moves logits through a quantized model's layers (llama.cpp's two
attention paths, with and without flash attention, differ by up to a logit on SmolLM2), so each
flash-attention decode is held to the path without flash attention (F32 softmax and products):
dsr1d's may stray from it no more than llama.cpp's own flash-attention decode does. Checked on
SmolLM2-135M-Instruct (3 query heads per KV head) reading a shipped text, and on a random model of
R1's vocabulary (2 per KV head): a prompt of 600 tokens in one batch, then 24 tokens one at a time
(or four at a time, as a speculative batch is checked), each position's logits kept; SmolLM2 with
a Q8_0 cache too (held to the same F16 reference: both flash-attention decodes carry the cache's
rounding).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_fixtures import smollm2  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "src" / "dsr1d" / "engine" / "corpus.txt"
PROMPT = 600
DECODED = 24

# loads the file with llama-cpp-python (dsr1d's build) with flash attention on or off, reads PROMPT
# tokens of the text in one batch and the next DECODED a few (STEP) at a time, and saves the
# decoded positions' logits
EVAL = """
import sys
import numpy as np
import llama_cpp
path, text, out = sys.argv[1], sys.argv[2], sys.argv[5]
n_prompt, n_decoded = int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2,
                      flash_attn=sys.argv[6] == "on", logits_all=True, verbose=False,
                      type_k=llama_cpp.GGML_TYPE_Q8_0 if sys.argv[7] == "q8_0" else llama_cpp.GGML_TYPE_F16,
                      type_v=llama_cpp.GGML_TYPE_Q8_0 if sys.argv[7] == "q8_0" else llama_cpp.GGML_TYPE_F16)
ids = llm.tokenize(open(text, encoding="utf-8").read().encode(), add_bos=True)
assert len(ids) >= n_prompt + n_decoded, len(ids)
llm.eval(ids[:n_prompt])
step = int(sys.argv[8])
for i in range(n_prompt, n_prompt + n_decoded, step):
    llm.eval(ids[i:min(i + step, n_prompt + n_decoded)])
np.save(out, np.array(llm.scores[n_prompt:n_prompt + n_decoded], dtype=np.float32))
np.save(out + ".ids", np.array(ids[n_prompt + 1:n_prompt + n_decoded + 1]))
"""


def _logits(path: Path, tmp: Path, decode: str, kv: str = "f16",
            step: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The decoded positions' logits and the text's next tokens; decode is "grouped" (dsr1d's),
    "per-head" (llama.cpp's flash attention) or "no-fa" (llama.cpp without flash attention), kv
    the cache's type, step the tokens decoded together."""
    out = tmp / f"{path.stem}-{decode}-{kv}-{step}.npy"
    env = dict(os.environ, DSR1D_FA_DECODE="0" if decode == "per-head" else "1")
    proc = subprocess.run([sys.executable, "-c", EVAL, str(path), str(CORPUS), str(PROMPT),
                           str(DECODED), str(out), "off" if decode == "no-fa" else "on", kv, str(step)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out), np.load(str(out) + ".ids.npy")


def _nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each position's negative log-likelihood of the text's next token."""
    rows = logits[: len(ids)].astype(np.float64)
    top = rows.max(axis=1)
    log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    return log_z - rows[np.arange(len(ids)), ids]


@pytest.fixture(scope="module")
def random_r1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    import random_gguf

    path = tmp_path_factory.mktemp("fa-decode") / "draft-f16-kv.gguf"
    random_gguf.write("draft", "Q8_0", path)
    return path


def _decodes(path: Path, tmp: Path, kv: str = "f16",
             step: int = 1) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each decode's logits (the flash-attention ones with a kv cache; the reference F16), and
    the text's next tokens."""
    runs = {decode: _logits(path, tmp, decode, kv, step) for decode in ("grouped", "per-head")}
    runs["no-fa"] = _logits(path, tmp, "no-fa", step=step)
    return {decode: run[0] for decode, run in runs.items()}, runs["no-fa"][1]


def _assert_no_farther_than_llama_cpps(logits: dict[str, np.ndarray]) -> None:
    reference = logits["no-fa"]
    ours = float(np.abs(logits["grouped"] - reference).mean())
    theirs = float(np.abs(logits["per-head"] - reference).mean())
    # a wrong row, head or block moves the logits by many times the rounding
    assert ours <= 1.25 * theirs, (
        f"dsr1d's decode is {ours:.5f} from the reference a logit on average, "
        f"llama.cpp's flash attention {theirs:.5f}")


def test_smollm2_reads_a_long_text_as_llama_cpps_decode_does(smollm2: Path,  # noqa: F811
                                                               tmp_path: Path) -> None:
    logits, ids = _decodes(smollm2, tmp_path)
    _assert_no_farther_than_llama_cpps(logits)
    agree = (logits["grouped"].argmax(axis=1) == logits["no-fa"].argmax(axis=1)).mean()
    assert agree >= 0.95, f"the most likely next token agrees at {agree:.0%} of positions"
    nll = {decode: float(_nll(rows, ids).mean()) for decode, rows in logits.items()}
    # the text is English the model reads well (2.96 nats a token): broken attention reads noise
    assert nll["grouped"] < 4.0, nll
    assert abs(nll["grouped"] - nll["no-fa"]) < 0.02 * nll["no-fa"], nll


def test_smollm2_checking_four_tokens_at_a_time_reads_as_llama_cpp_does(
        smollm2: Path, tmp_path: Path) -> None:  # noqa: F811
    logits, ids = _decodes(smollm2, tmp_path, step=4)
    _assert_no_farther_than_llama_cpps(logits)
    agree = (logits["grouped"].argmax(axis=1) == logits["no-fa"].argmax(axis=1)).mean()
    assert agree >= 0.95, f"the most likely next token agrees at {agree:.0%} of positions"
    nll = {decode: float(_nll(rows, ids).mean()) for decode, rows in logits.items()}
    assert abs(nll["grouped"] - nll["no-fa"]) < 0.02 * nll["no-fa"], nll


def test_smollm2_with_a_q8_0_cache_reads_as_llama_cpps_decode_does(smollm2: Path,  # noqa: F811
                                                                    tmp_path: Path) -> None:
    logits, ids = _decodes(smollm2, tmp_path, kv="q8_0")
    _assert_no_farther_than_llama_cpps(logits)
    nll = {decode: float(_nll(rows, ids).mean()) for decode, rows in logits.items()}
    assert abs(nll["grouped"] - nll["no-fa"]) < 0.02 * nll["no-fa"], nll


def test_a_random_r1_vocabulary_model_decodes_as_llama_cpps_does(random_r1: Path,
                                                                   tmp_path: Path) -> None:
    _assert_no_farther_than_llama_cpps(_decodes(random_r1, tmp_path)[0])
