"""The R1-Distill-Llama family (8B/70B) loads and generates through the same engine path.

A tiny LlamaForCausalLM with the synthetic R1 tokenizer stands in for the real checkpoints:
what is under test is the architecture dispatch, the loader and the quantised linears.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from dsr1d.engine.generate import Generator  # noqa: E402
from dsr1d.engine.model import load  # noqa: E402
from engine_fixtures import tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    out = tiny_llama(tmp_path_factory.mktemp("r1-llama-tiny"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    return out


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
def test_llama_loads_and_generates(llama_dir, dtype):
    loaded = load(llama_dir, dtype)
    assert loaded.dtype == dtype
    result = Generator(loaded).generate("hello", {"greedy": True, "max_new_tokens": 12,
                                                  "ignore_eos": True})
    assert result.stats["new_tokens"] == 12
    assert result.stats["finish_reason"] == "length"


def test_llama_greedy_matches_transformers(llama_dir):
    from transformers import AutoModelForCausalLM

    loaded = load(llama_dir, "fp32")
    gen = Generator(loaded)
    ids = gen.encode("hello")
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected = loaded.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    result = gen.generate("hello", {"greedy": True, "max_new_tokens": 16, "ignore_eos": True})
    assert result.text == expected
