"""The IQ4_NL quantiser: read back by gguf, and the same bytes as llama.cpp's own quantiser."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # the synthetic model is made with torch
llama_cpp = pytest.importorskip("llama_cpp")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from dsr1d.engine import synth  # noqa: E402
from dsr1d.engine.gguf_convert import convert  # noqa: E402
from dsr1d.engine.iq4nl import GRID, nearest, quantize_iq4_nl  # noqa: E402

LLAMA_FTYPE_MOSTLY_IQ4_NL = 25


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_nearest_takes_the_closest_grid_value_and_ties_go_up() -> None:
    y = np.array([-500, -127, -115.6, -115.5, -115.4, 0, 7, 6.99, 101, 113, 500],
                 dtype=np.float32)
    assert GRID[nearest(y)].tolist() == [-127, -127, -127, -104, -104, 1, 13, 1, 113, 113, 113]


def test_round_trip_through_gguf_beats_q4_0_and_keeps_zero_blocks_zero() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_t(5, size=(256, 512)).astype(np.float32) * 0.02
    x[7, 64:96] = 0.0
    q = quantize_iq4_nl(x)
    assert q.shape == (256, 512 // 32 * 18) and q.dtype == np.uint8
    back = dequantize(q, QT.IQ4_NL)
    assert np.all(back[7, 64:96] == 0.0)
    q4 = dequantize(quantize(x, QT.Q4_0), QT.Q4_0)
    assert _rms(back - x) < 0.95 * _rms(q4 - x)
    # a block already on the grid (its scale an f16) comes back exactly
    d = np.float16(0.01).astype(np.float32)
    on_grid = (d * GRID[rng.integers(0, 16, size=32)]).reshape(1, 32)
    on_grid[0, 0] = d * GRID[0]      # the grid's end is used, so the first guess is exact
    np.testing.assert_array_equal(dequantize(quantize_iq4_nl(on_grid), QT.IQ4_NL), on_grid)


def test_large_arrays_split_across_threads_give_the_same_bytes() -> None:
    x = np.random.default_rng(4).normal(size=(4096, 640)).astype(np.float32)   # 2 threads
    whole = quantize_iq4_nl(x)
    rows = np.concatenate([quantize_iq4_nl(x[i:i + 64]) for i in range(0, len(x), 64)])
    np.testing.assert_array_equal(whole, rows)


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = synth.synthesize("tiny", tmp_path_factory.mktemp("hf") / "R1-tiny", seed=0)
    return convert(src, tmp_path_factory.mktemp("gguf") / "tiny-fp32.gguf", "fp32")


def test_the_same_blocks_as_llama_cpp_quantizes(tiny_fp32: Path, tmp_path: Path) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = LLAMA_FTYPE_MOSTLY_IQ4_NL, True, 2
    theirs_path = tmp_path / "tiny-iq4_nl.gguf"
    assert llama_cpp.llama_model_quantize(str(tiny_fp32).encode(), str(theirs_path).encode(),
                                          ctypes.byref(params)) == 0
    source = {t.name: t for t in GGUFReader(tiny_fp32).tensors}
    compared = 0
    for tensor in GGUFReader(theirs_path).tensors:
        if tensor.tensor_type != QT.IQ4_NL:
            continue
        x = np.array(source[tensor.name].data, dtype=np.float32).reshape(-1, int(tensor.shape[0]))
        ours = quantize_iq4_nl(x).reshape(-1, 18)
        theirs = np.array(tensor.data).reshape(-1, 18)
        # float sums in another order may tip a near-tie between two scales, rarely
        assert (ours == theirs).all(axis=1).mean() >= 0.99, tensor.name
        err_ours = _rms(dequantize(ours.reshape(len(x), -1), QT.IQ4_NL) - x)
        err_theirs = _rms(dequantize(theirs.reshape(len(x), -1), QT.IQ4_NL) - x)
        assert err_ours <= err_theirs * 1.01, tensor.name
        compared += 1
    assert compared >= 10
