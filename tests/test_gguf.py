"""The GGUF side of the llama.cpp engine: the HF -> GGUF converter and the validating reader.

Everything runs on the tiny synthetic R1-Distill-Qwen model (and a tiny Llama built the way
test_engine_llama.py builds one): about 20 s on two cores, a quarter of it importing
transformers. ``gguf`` and ``llama_cpp`` are engine dependencies the project installs: without
them these tests fail rather than skip.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import unicodedata
from functools import lru_cache
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")  # the synthetic models are made with torch

import gguf  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from dsr1d.engine import gguf_convert, synth  # noqa: E402
from engine_fixtures import tiny_llama  # noqa: E402
from dsr1d.engine.errors import ModelError  # noqa: E402
from dsr1d.engine.gguf_convert import convert, convert_main  # noqa: E402
from dsr1d.engine.gguf_file import GGUFInfo, inspect_gguf, memory_needed  # noqa: E402

DTYPES = ("fp32", "bf16", "int8", "int4")
QT = gguf.GGMLQuantizationType
CORPUS = Path(synth.__file__).with_name("corpus.txt")
# Beyond the corpus: numbers (Qwen2 splits digits one by one, Llama 3 in threes), whitespace runs,
# non-Latin scripts and emoji (multi-byte and ZWJ sequences), contractions (the regex's (?i:)
# group), added tokens inside text, and llama.cpp's own pre-tokenizer check string.
EXTRA_TEXTS = [
    "3 33 333 3333 33333 3.14159 1,000,000 2025-01-20 0x1F",
    "  two leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines \n \n",
    "Ünïcödé naïve café, façade; Здравствуйте; Γειά σου; 日本語のテキスト; 中文; 한국어",
    "emoji 🚀 (normal) 😶\u200d🌫️ ✅ 🦙🦙",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like tea? "
    "We'Ve a'lL",
    "<think>\nLet me think.\n</think>\n\nThe answer is 42.",
    "<｜User｜>hi<｜Assistant｜>hello<｜end▁of▁sentence｜>",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "content": "<think>\n17 * 23 = 391.\n</think>\n\n391"},
    {"role": "user", "content": "And in hex? Ünïcödé, please 🚀"},
]


# --- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.synthesize("tiny", tmp_path_factory.mktemp("hf") / "R1-tiny", seed=0)


@pytest.fixture(scope="module")
def converted(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    return {d: convert(qwen_dir, out / f"tiny-{d}.gguf", d) for d in DTYPES}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForCausalLM with the synthetic tokenizer and Llama 3.1's rope scaling."""
    return tiny_llama(tmp_path_factory.mktemp("hf-llama") / "R1-llama-tiny", head_std=0.25,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 256})


@lru_cache(maxsize=16)
def _reader(path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)  # half a second for a 4000-token vocabulary


def _fields(path: Path) -> dict:
    return {name: field.contents() for name, field in _reader(path).fields.items()}


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """GGUF tensors dequantised to float32 in numpy order, by name."""
    out = {}
    for t in _reader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    return out


def _types(path: Path) -> dict[str, QT]:
    return {t.name: t.tensor_type for t in _reader(path).tensors}


def _source(model_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def _hf_name(gguf_name: str) -> str:
    for hf, g in gguf_convert.GLOBAL_TENSORS.items():
        if g == gguf_name:
            return hf
    _, layer, rest = gguf_name.split(".", 2)
    hf_suffix = {v: k for k, v in gguf_convert.LAYER_TENSORS.items()}[rest]
    return f"model.layers.{layer}.{hf_suffix}"


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Llama q/k row order: each head's two rotary halves interleaved pair-wise."""
    half = w.shape[0] // heads // 2
    order = [h * 2 * half + j + k * half for h in range(heads) for j in range(half) for k in (0, 1)]
    return w[order]


def _block_max(w: np.ndarray) -> np.ndarray:
    """Each value's 32-value quantisation block's absolute maximum, in w's shape."""
    blocks = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True)
    return np.broadcast_to(blocks, (blocks.shape[0], 32)).reshape(w.shape)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".partial" in p.name)


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:  # the project installs it: its absence is a failure
        pytest.fail(f"llama_cpp is not importable ({exc}); the engine extras install it")
    return llama_cpp


# --- round trip ----------------------------------------------------------------------------------

def test_metadata_round_trip(converted: dict[str, Path], qwen_dir: Path) -> None:
    fields = _fields(converted["int4"])
    config = json.loads((qwen_dir / "config.json").read_text())
    tok = json.loads((qwen_dir / "tokenizer.json").read_text())
    ids = synth.special_ids()
    assert fields["general.architecture"] == "qwen2"
    assert fields["general.name"] == "R1-tiny"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    assert fields["qwen2.context_length"] == config["max_position_embeddings"] == 4096
    assert fields["qwen2.embedding_length"] == 64
    assert fields["qwen2.block_count"] == 2
    assert fields["qwen2.feed_forward_length"] == 192
    assert fields["qwen2.attention.head_count"] == 4
    assert fields["qwen2.attention.head_count_kv"] == 2
    assert fields["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert fields["qwen2.rope.freq_base"] == 10000
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == config["vocab_size"] == 4032
    assert all(tokens[i] == t for t, i in tok["model"]["vocab"].items())
    assert tokens[4000:] == [f"[PAD{i}]" for i in range(4000, 4032)]
    assert set(types[4000:]) == {gguf.TokenType.UNUSED}
    assert types[ids[synth.BOS]] == types[ids[synth.USER]] == gguf.TokenType.CONTROL
    assert types[ids[synth.THINK]] == types[ids[synth.END_THINK]] == gguf.TokenType.USER_DEFINED
    assert types[tok["model"]["vocab"]["Ġthe"]] == gguf.TokenType.NORMAL
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) for m in tok["model"]["merges"]]
    assert fields["tokenizer.ggml.bos_token_id"] == ids[synth.BOS]
    assert fields["tokenizer.ggml.eos_token_id"] == ids[synth.EOS]
    assert fields["tokenizer.ggml.padding_token_id"] == ids[synth.EOS]
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.ggml.add_eos_token"] is False
    assert fields["tokenizer.chat_template"] == synth.CHAT_TEMPLATE
    assert fields["general.sampling.temp"] == pytest.approx(0.6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_round_trip(converted: dict[str, Path], qwen_dir: Path, dtype: str) -> None:
    source = _source(qwen_dir)
    tensors, types = _tensors(converted[dtype]), _types(converted[dtype])
    assert {_hf_name(n) for n in tensors} == set(source)
    for name, values in tensors.items():
        want = source[_hf_name(name)]
        assert values.shape == want.shape, name
        if want.ndim == 1:
            assert types[name] == QT.F32, name
            np.testing.assert_array_equal(values, want, err_msg=name)
        elif dtype in ("fp32", "bf16"):
            # The source is bf16: widening to f32 and copying bf16 are both exact.
            assert types[name] == (QT.F32 if dtype == "fp32" else QT.BF16), name
            np.testing.assert_array_equal(values, want, err_msg=name)
        else:
            # Per 32-value block, step d = blockmax/127 (Q8_0) or blockmax/8 (Q4_0): rounding
            # errs by d/2, and Q4_0's codes -8..7 clip the far extreme by a whole d. The scale
            # is stored as f16 (2**-11 relative), scaled by the code: up to 127 or 8 times.
            qtype = QT.Q8_0 if dtype == "int8" or name == "token_embd.weight" else \
                QT.IQ4_NL if name == "output.weight" else QT.Q4_0
            assert types[name] == qtype, name
            if qtype == QT.IQ4_NL:
                # a better 4-bit grid than Q4_0's: closer to the weights than Q4_0 would be
                q4 = dequantize(quantize(want.astype(np.float32), QT.Q4_0), QT.Q4_0)
                assert _rms(values - want) < _rms(q4 - want), name
                continue
            if qtype == QT.Q8_0:
                bound = _block_max(want) / 127 * (0.5 + 127 * 2.0**-11)
            else:
                bound = _block_max(want) / 8 * (1 + 8 * 2.0**-11)
            assert np.all(np.abs(values - want) <= bound + 1e-8), name


def test_fp32_checkpoint_to_bf16_rounds_to_nearest(tmp_path: Path) -> None:
    src = synth.synthesize("tiny", tmp_path / "f32", dtype="float32")
    out = convert(src, tmp_path / "m.gguf", "bf16")
    source, types = _source(src), _types(out)
    for name, values in _tensors(out).items():
        want = source[_hf_name(name)]
        if types[name] == QT.F32:
            np.testing.assert_array_equal(values, want, err_msg=name)
        else:  # round to nearest even, as torch does
            rounded = torch.from_numpy(want).bfloat16().float().numpy()
            np.testing.assert_array_equal(values, rounded, err_msg=name)


def test_fp16_checkpoint_converts_exactly(qwen_dir: Path, tmp_path: Path) -> None:
    src = Path(shutil.copytree(qwen_dir, tmp_path / "f16"))
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.half() for k, v in weights.items()}, str(src / "model.safetensors"))
    source = {k: v.half().float().numpy() for k, v in weights.items()}
    for name, values in _tensors(convert(src, tmp_path / "m.gguf", "fp32")).items():
        np.testing.assert_array_equal(values, source[_hf_name(name)], err_msg=name)


def test_tied_embeddings_serve_as_the_output(qwen_dir: Path, tmp_path: Path) -> None:
    """No output.weight: llama.cpp reuses token_embd, which int4 then keeps at Q8_0."""
    src = Path(shutil.copytree(qwen_dir, tmp_path / "tied"))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    out = convert(src, tmp_path / "tied.gguf", "int4")
    types = _types(out)
    assert "output.weight" not in types and types["token_embd.weight"] == QT.Q8_0
    # logits_all: without it llama-cpp-python fills no row of .scores (it samples in llama.cpp)
    llm = _llama_cpp().Llama(model_path=str(out), n_ctx=32, n_threads=2, verbose=False,
                             logits_all=True)
    llm.eval([5, 6, 7])
    scores = np.array(llm.scores[:3])
    assert np.isfinite(scores).all() and (np.ptp(scores, axis=1) > 0).all()


def test_rows_that_do_not_fill_quant_blocks_stay_bf16() -> None:
    assert gguf_convert._tensor_type("blk.0.ffn_down.weight", (64, 200), "int4") == QT.BF16
    assert gguf_convert._tensor_type("blk.0.ffn_down.weight", (64, 192), "int4") == QT.Q4_0


@pytest.mark.parametrize("dtype", DTYPES)
def test_inspect_reports_the_model(converted: dict[str, Path], qwen_dir: Path,
                                   dtype: str) -> None:
    info = inspect_gguf(converted[dtype])
    config = json.loads((qwen_dir / "config.json").read_text())
    assert isinstance(info, GGUFInfo)
    assert info.architecture == "qwen2"
    assert info.name == "R1-tiny"
    assert info.file_type == dtype
    assert info.parameters == synth.parameter_count(config)
    assert info.tensor_bytes == sum(int(t.n_bytes) for t in _reader(info.path).tensors)
    assert info.tensor_bytes < converted[dtype].stat().st_size
    assert (info.context_length, info.block_count, info.embedding_length) == (4096, 2, 64)
    assert (info.vocab_size, info.has_vocab) == (4032, True)
    assert (info.bos_id, info.eos_id) == (synth.special_ids()[synth.BOS],
                                         synth.special_ids()[synth.EOS])
    assert info.chat_template == synth.CHAT_TEMPLATE
    # f16 KV cache of 2 layers x 4096 positions x 2 kv heads x 16 dims x (k, v) = 1 MiB.
    kv_cache = 2 * 2 * 4096 * 2 * 16 * 2
    assert memory_needed(info) > info.tensor_bytes + kv_cache
    assert memory_needed(info, context=512) < memory_needed(info)


def test_file_type_without_general_file_type(tmp_path: Path) -> None:
    """Files from elsewhere may lack general.file_type: the weights' own type names them."""
    path = _write_gguf(tmp_path / "q6.gguf", "qwen2", tensor_type=QT.Q6_K, file_type=None)
    assert inspect_gguf(path).file_type == "Q6_K"
    path = _write_gguf(tmp_path / "q4km.gguf", "qwen2", file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert inspect_gguf(path).file_type == "Q4_K_M"


def test_sharded_checkpoint_converts_to_the_same_file(qwen_dir: Path, converted: dict[str, Path],
                                                      tmp_path: Path) -> None:
    src = _sharded_copy(qwen_dir, tmp_path / "sharded" / "R1-tiny")
    out = convert(src, tmp_path / "sharded.gguf", "int4")
    assert out.read_bytes() == converted["int4"].read_bytes()


def _sharded_copy(model_dir: Path, dst: Path) -> Path:
    """The model split in two safetensors shards with an index, like the real checkpoints."""
    shutil.copytree(model_dir, dst)
    (dst / "model.safetensors").unlink()
    weights = load_file(str(model_dir / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in shards.items():
        save_file({n: weights[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


# --- Llama ---------------------------------------------------------------------------------------

def test_llama_converts(llama_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    out = convert(llama_dir, tmp_path / "llama.gguf", "fp32")
    fields, tensors = _fields(out), _tensors(out)
    source = {k: v.float().numpy() for k, v in load_file(
        str(llama_dir / "model.safetensors")).items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.rope.dimension_count"] == 16
    assert fields["llama.vocab_size"] == synth.tokenizer_size() + 32
    assert fields["llama.rope.freq_base"] == 500000.0
    assert fields["tokenizer.ggml.pre"] == "qwen2"  # the synthetic tokenizer is Qwen's
    for name in ("blk.1.attn_q.weight", "blk.1.attn_k.weight"):
        heads = 4 if "attn_q" in name else 2
        np.testing.assert_array_equal(tensors[name], _permuted(source[_hf_name(name)], heads))
    np.testing.assert_array_equal(tensors["blk.1.attn_v.weight"],
                                  source["model.layers.1.self_attn.v_proj.weight"])
    # rope_freqs holds the divisor llama3 scaling applies to each rotary frequency.
    config = LlamaConfig.from_pretrained(llama_dir)
    default = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    np.testing.assert_allclose(tensors["rope_freqs.weight"], default / scaled.numpy(), rtol=1e-5)
    info = inspect_gguf(out)
    assert (info.architecture, info.file_type, info.context_length) == ("llama", "fp32", 2048)


# --- llama.cpp: the converted files load and compute what transformers computes ---------------

@pytest.fixture(scope="module")
def llama3_tokenizer_dir(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a BPE trained on Llama 3's split (digits in threes, ignore_merges)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import trainers

    dst = Path(shutil.copytree(qwen_dir, tmp_path_factory.mktemp("llama3-tok") / "R1-tiny"))
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(gguf_convert.LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=synth.TOKENIZER_SIZE - len(synth.ADDED_TOKENS),
                                  min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    numbers = " ".join(str(n) for n in range(0, 100000, 37))  # so that digit merges exist
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").split("\n\n") + [numbers],
                            trainer)
    for content, special in synth.ADDED_TOKENS:
        token = AddedToken(content, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    tok.save(str(dst / "tokenizer.json"))
    return dst


def _assert_same_token_ids(gguf_path: Path, tokenizer_json: Path) -> None:
    from tokenizers import Tokenizer

    llm = _llama_cpp().Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    hf = Tokenizer.from_file(str(tokenizer_json))
    mismatches = []
    for text in _texts():
        want = hf.encode(text, add_special_tokens=False).ids
        got = llm.tokenize(text.encode(), add_bos=False, special=True)
        if got != want:
            mismatches.append((text[:60], got[:12], want[:12]))
        assert llm.detokenize(got, special=True) == text.encode(), text[:60]
    assert not mismatches, mismatches[:3]


def _llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    llama_cpp = _llama_cpp()
    n = max(64, len(ids))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n, n_batch=n, n_threads=2,
                          logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def _transformers_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


PROMPT_IDS = list(range(5, 45))  # 40 ordinary tokens


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_llama_cpp_logits_match_transformers(arch: str, qwen_dir: Path, llama_dir: Path,
                                             tmp_path: Path) -> None:
    model_dir = qwen_dir if arch == "qwen2" else llama_dir
    out = convert(model_dir, tmp_path / f"{arch}.gguf", "fp32")
    got = _llama_cpp_logits(out, PROMPT_IDS)
    want = _transformers_logits(model_dir, PROMPT_IDS)[:, : got.shape[1]]
    # llama.cpp keeps the KV cache in f16: the logits differ by ~0.1 % of their spread (measured
    # 0.0016 at std 2). A missed q/k permutation or a wrong rope moves them by their own size.
    assert np.abs(got - want).max() < 0.02 * want.std(), arch
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.95


def test_the_int4_mix_is_closer_to_fp32_than_the_alternatives(
        qwen_dir: Path, converted: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement behind the int4 mix (output IQ4_NL, embedding Q8_0): its logits are
    closer to the fp32 file's than those of the mix before (output Q8_0, embedding Q4_0), a
    file of the same size, and than everything at Q4_0."""
    llm = _llama_cpp().Llama(model_path=str(converted["fp32"]), vocab_only=True, verbose=False)
    ids = llm.tokenize(CORPUS.read_text(encoding="utf-8").encode(), add_bos=False)[:600]
    reference = _llama_cpp_logits(converted["fp32"], ids)

    def error(output: QT | None, embedding: QT | None) -> float:
        if output is None:
            path = converted["int4"]
        else:
            types = {"output.weight": output, "token_embd.weight": embedding}
            monkeypatch.setattr(gguf_convert, "_tensor_type", lambda name, shape, dtype:
                                QT.F32 if len(shape) == 1 else types.get(name, QT.Q4_0))
            path = convert(qwen_dir, tmp_path / f"{output.name}-{embedding.name}.gguf", "int4")
        return _rms(_llama_cpp_logits(path, ids) - reference)

    chosen = error(None, None)
    assert chosen < error(QT.Q8_0, QT.Q4_0)
    assert chosen < error(QT.Q4_0, QT.Q4_0)


# --- llama.cpp tokenizes exactly as the Hugging Face tokenizer ---------------------------------

def _texts() -> list[str]:
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = lines + EXTRA_TEXTS
    # llama.cpp does not apply the tokenizer's NFC normaliser: inputs must already be NFC.
    assert all(unicodedata.is_normalized("NFC", t) for t in texts)
    return texts


def test_token_ids_match_the_hf_tokenizer(converted: dict[str, Path], qwen_dir: Path) -> None:
    _assert_same_token_ids(converted["int4"], qwen_dir / "tokenizer.json")
    # Without special=True, control tokens are plain text, but <think> (USER_DEFINED) is a token.
    llm = _llama_cpp().Llama(model_path=str(converted["int4"]), vocab_only=True, verbose=False)
    think = synth.special_ids()[synth.THINK]
    assert llm.tokenize(b"<think>", add_bos=False, special=False) == [think]
    assert synth.special_ids()[synth.USER] not in llm.tokenize(
        synth.USER.encode(), add_bos=False, special=False)


def test_llama3_pre_tokenizer_token_ids_match(llama3_tokenizer_dir: Path, tmp_path: Path) -> None:
    out = convert(llama3_tokenizer_dir, tmp_path / "l3.gguf", "int4")
    assert _fields(out)["tokenizer.ggml.pre"] == "llama-bpe"
    _assert_same_token_ids(out, llama3_tokenizer_dir / "tokenizer.json")


def test_chat_template_tokens_match_the_hf_tokenizer(converted: dict[str, Path],
                                                     qwen_dir: Path) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    llama_cpp = _llama_cpp()
    path = converted["int8"]
    fields = _fields(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    hf = AutoTokenizer.from_pretrained(str(qwen_dir), local_files_only=True)
    encoded = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    want = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    tokens = fields["tokenizer.ggml.tokens"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(fields["tokenizer.chat_template"]).render(
        messages=CHAT, add_generation_prompt=True,
        bos_token=tokens[fields["tokenizer.ggml.bos_token_id"]],
        eos_token=tokens[fields["tokenizer.ggml.eos_token_id"]])
    assert text.startswith(synth.BOS) and text.endswith(synth.ASSISTANT + synth.THINK + "\n")
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == want


# --- the reader refuses broken files with a message a user understands -------------------------

def _write_gguf(path: Path, arch: str, *, tensor_type: QT = QT.F32, keys: bool = True,
                file_type: gguf.LlamaFileType | None = gguf.LlamaFileType.ALL_F32) -> Path:
    """A small GGUF written by gguf's own writer: one 2-D tensor and the metadata asked for."""
    writer = gguf.GGUFWriter(path, arch)
    if keys:
        for key, value in (("context_length", 128), ("embedding_length", 256),
                           ("block_count", 1), ("feed_forward_length", 512)):
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_head_count(4)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    rows, cols = 4, 256
    data = np.zeros((rows, cols // block * type_size), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refused(path: Path) -> str:
    with pytest.raises(ModelError) as exc:
        inspect_gguf(path)
    message = str(exc.value)
    assert "\n" not in message and str(path) in message
    return message


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert "does not exist" in _refused(tmp_path / "nope.gguf")
    assert "is a directory" in _refused(tmp_path)


def test_empty_garbage_and_bad_magic(tmp_path: Path, qwen_dir: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "empty" in _refused(tmp_path / "empty.gguf")
    (tmp_path / "short.gguf").write_bytes(b"GG")
    assert "not a GGUF file" in _refused(tmp_path / "short.gguf")
    garbage = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    (tmp_path / "garbage.gguf").write_bytes(garbage)
    assert "not a GGUF file" in _refused(tmp_path / "garbage.gguf")
    message = _refused(qwen_dir / "model.safetensors")  # a common mistake
    assert "not a GGUF file" in message and "dsr1d model convert" in message
    (tmp_path / "noise.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + garbage)
    message = _refused(tmp_path / "noise.gguf")
    assert "not a valid GGUF file" in message or "truncated" in message


def test_unsupported_versions(tmp_path: Path, converted: dict[str, Path]) -> None:
    data = bytearray(converted["int4"].read_bytes())
    data[4:8] = struct.pack("<I", 1)
    (tmp_path / "v1.gguf").write_bytes(data)
    assert "GGUF version 1 is not supported" in _refused(tmp_path / "v1.gguf")
    data[4:8] = struct.pack(">I", 3)
    (tmp_path / "be.gguf").write_bytes(data)
    assert "big-endian" in _refused(tmp_path / "be.gguf")


def test_truncated_files(tmp_path: Path, converted: dict[str, Path]) -> None:
    full = converted["int4"].read_bytes()
    data_start = min(int(t.data_offset) for t in _reader(converted["int4"]).tensors)
    tokens_at = full.index(b"tokenizer.ggml.tokens")
    cuts = {"header": 12, "metadata": tokens_at + 5000, "tensor infos": data_start - 40,
            "first tensor": data_start + 100, "last bytes": len(full) - 1}
    for where, cut in cuts.items():
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(full[:cut])
        message = _refused(path)
        assert "truncated" in message and "again" in message, where
    # Wherever the cut, it is a ModelError (never an IndexError or struct.error from parsing).
    for cut in range(0, len(full), len(full) // 60):
        path = tmp_path / "cut.gguf"
        path.write_bytes(full[:cut])
        _refused(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    message = _refused(_write_gguf(tmp_path / "gpt2.gguf", "gpt2"))
    assert "architecture 'gpt2' is not supported" in message
    assert "qwen2" in message and "llama" in message


def test_missing_metadata(tmp_path: Path) -> None:
    message = _refused(_write_gguf(tmp_path / "bare.gguf", "qwen2", keys=False))
    assert "required metadata qwen2." in message and "missing" in message


# --- the converter refuses what it cannot convert, and never leaves a partial OUT ---------------

def _broken_copy(qwen_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(qwen_dir, tmp_path / "broken"))


def _conversion_refused(src: Path, out: Path) -> str:
    with pytest.raises(ModelError) as exc:
        convert(src, out, "int8")
    assert not out.exists() and not _leftovers(out.parent)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_refuses_bad_directories(qwen_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    src = _broken_copy(qwen_dir, tmp_path)
    assert "does not exist" in _conversion_refused(tmp_path / "nothing", out)
    (src / "config.json").rename(src / "config.json.bak")
    assert "no config.json" in _conversion_refused(src, out)
    config = json.loads((src / "config.json.bak").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    message = _conversion_refused(src, out)
    assert "unsupported architecture GPT2LMHeadModel" in message and "Qwen2ForCausalLM" in message
    (src / "config.json.bak").rename(src / "config.json")
    (src / "tokenizer.json").rename(src / "tokenizer.json.bak")
    assert "no tokenizer.json" in _conversion_refused(src, out)


def test_refuses_an_unknown_pre_tokenizer(qwen_dir: Path, tmp_path: Path) -> None:
    src = _broken_copy(qwen_dir, tmp_path)
    tok = json.loads((src / "tokenizer.json").read_text())
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = gpt2
    (src / "tokenizer.json").write_text(json.dumps(tok))
    message = _conversion_refused(src, tmp_path / "out.gguf")
    assert "unknown split regex" in message and "split text differently" in message


def test_refuses_corrupt_safetensors(qwen_dir: Path, tmp_path: Path) -> None:
    src = _broken_copy(qwen_dir, tmp_path)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    message = _conversion_refused(src, tmp_path / "out.gguf")
    assert "not a valid safetensors file" in message and "truncated" in message
    weights.write_bytes(b"\xff" * 64)
    assert "not a valid safetensors file" in _conversion_refused(src, tmp_path / "out.gguf")


def test_refuses_a_corrupt_second_shard(qwen_dir: Path, tmp_path: Path) -> None:
    src = _sharded_copy(qwen_dir, tmp_path / "sharded")
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert shard.name in _conversion_refused(src, tmp_path / "out.gguf")


def test_refuses_when_the_disk_is_too_small(qwen_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_convert.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    assert "not enough free disk space" in _conversion_refused(qwen_dir, tmp_path / "out.gguf")


def test_interrupted_conversion_leaves_no_file(qwen_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    calls = []

    def interrupt(done: int, total: int, name: str) -> None:
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(qwen_dir, out, "int4", progress=interrupt)
    assert not out.exists() and not _leftovers(tmp_path)
    out.write_bytes(b"an earlier file")  # an old OUT is replaced only by a complete new one
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        convert(qwen_dir, out, "int4", progress=interrupt)
    assert out.read_bytes() == b"an earlier file" and not _leftovers(tmp_path)


# --- the command line ----------------------------------------------------------------------------

def test_convert_main(qwen_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert convert_main([str(qwen_dir), str(out), "--dtype", "int8"]) == 0
    captured = capsys.readouterr()
    assert str(out) in captured.out and "614,976 parameters" in captured.out
    assert "int8" in captured.out and " s\n" in captured.out
    assert "blk.1" in captured.err and "100%" in captured.err
    assert inspect_gguf(out).file_type == "int8"


def test_convert_main_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert convert_main([str(tmp_path / "missing"), str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsr1d model convert: error: ") and "does not exist" in err
    assert "Traceback" not in err and not (tmp_path / "x.gguf").exists()
    (tmp_path / "empty").mkdir()
    assert convert_main([str(tmp_path / "empty"), str(tmp_path / "x.gguf")]) == 1
    assert "no config.json" in capsys.readouterr().err


def test_a_conversion_is_current_until_its_source_or_the_layout_changes(
        qwen_dir: Path, tmp_path: Path) -> None:
    src = Path(shutil.copytree(qwen_dir, tmp_path / "src"))
    out = convert(src, tmp_path / "m.gguf", "int4")
    assert gguf_convert.layout_of(out) == gguf_convert.LAYOUT
    assert gguf_convert.is_current(out, src)
    assert not gguf_convert.is_current(tmp_path / "missing.gguf", src)
    later = out.stat().st_mtime + 10
    os.utime(src / "config.json", (later, later))          # the source edited since
    assert not gguf_convert.is_current(out, src)
    os.utime(out, (later + 10, later + 10))
    assert gguf_convert.is_current(out, src)
    old = tmp_path / "old.gguf"                             # written before layouts existed
    writer = gguf.GGUFWriter(str(old), "qwen2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_convert.layout_of(old) is None and not gguf_convert.is_current(old, src)
