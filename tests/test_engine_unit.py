"""The inference engine in-process (dsr1d.engine.*, dsr1d.edges.engine_host.validate_options) on the
tiny synthetic R1-Distill-Qwen model: loading errors, the loader against transformers' own,
greedy decoding against ``model.generate``, weight-only int8/int4 against the fp32 reference,
sampling, the chat template, streaming text (UTF-8 and the ``</think>`` split), limits, cancel.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsr1d.edges.engine_host import InvalidArgument, validate_options  # noqa: E402
from dsr1d.engine import synth  # noqa: E402
from dsr1d.engine.generate import Generator, InvalidRequest  # noqa: E402
from dsr1d.engine.model import DTYPES, ModelError, check_memory, choose_dtype, load  # noqa: E402
from dsr1d.engine.quant import INT4_GROUP, Int4Linear, Int8Linear  # noqa: E402
from dsr1d.textstream import IncrementalDecoder, ThinkSplitter  # noqa: E402
pytest.register_assert_rewrite("engine_fixtures", "daemon_fixtures")
from engine_fixtures import copy_model, forced_token_model  # noqa: E402

pytest_plugins = ["engine_fixtures"]

# A prompt on which the tiny model's greedy continuation is varied (33 distinct tokens in 40),
# so comparing decode loops compares something; "hi" degenerates into one repeated token.
PROMPT = "Why is the sky blue?"
# Fixed inputs for the logits comparisons: 42 positions of ordinary text.
TEXT = ("Why is the sky blue? Because air scatters short wavelengths more than long ones. "
        "Two cores read about 41 GB/s of weights; decode is memory-bound.")
GREEDY = {"greedy": True, "ignore_eos": True}


class Recorder(torch.nn.Module):
    """Wraps a model and keeps the ``input_ids`` of every forward call: the ids the decode loop
    fed back, i.e. the tokens it generated (the code under test is not touched: the wrapper is
    handed to it as the model, like any other ``nn.Module``)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[list[int]] = []

    @property
    def config(self):
        return self.inner.config

    def forward(self, input_ids, **kwargs):
        self.calls.append(input_ids[0].tolist())
        return self.inner(input_ids=input_ids, **kwargs)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load(tiny_model, "fp32")


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded.tokenizer


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def reference_logits(loaded):
    ids = loaded.tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.inference_mode():
        return ids, loaded.model(ids).logits[0, :, :len(loaded.tokenizer)].float()


def recording(loaded) -> tuple[Generator, Recorder]:
    recorder = Recorder(loaded.model)
    return Generator(dataclasses.replace(loaded, model=recorder)), recorder


def generated_ids(recorder: Recorder) -> list[int]:
    """The tokens a run generated before its last one (each decode step feeds one back)."""
    return [ids[0] for ids in recorder.calls[1:]]


# -- loading errors ------------------------------------------------------------------------------

def _rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _drop_tensor(path, name):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights[name]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


BREAKAGES = {
    # id: (how to break a copy of the tiny model, what the message must say)
    "missing-dir": (lambda p: p.rename(p.with_name("gone")), ["does not exist"]),
    "no-config": (lambda p: (p / "config.json").unlink(), ["no config.json"]),
    "invalid-json": (lambda p: (p / "config.json").write_text("{\"architectures\": [Qwen2"),
                     ["config.json", "not valid JSON"]),
    "gpt2": (lambda p: _rewrite_config(p, architectures=["GPT2LMHeadModel"], model_type="gpt2"),
             ["unsupported architecture GPT2LMHeadModel", "Qwen2ForCausalLM",
              "LlamaForCausalLM"]),
    "no-safetensors": (lambda p: (p / "model.safetensors").unlink(), ["no *.safetensors"]),
    "no-tokenizer": (lambda p: (p / "tokenizer.json").unlink(), ["no tokenizer.json", "fast"]),
    "missing-weight": (lambda p: _drop_tensor(p, "model.layers.1.mlp.up_proj.weight"),
                       ["weights missing", "model.layers.1.mlp.up_proj.weight"]),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_load_refuses_an_unusable_directory_with_a_clear_message(tiny_model, tmp_path, breakage):
    path = copy_model(tiny_model, tmp_path / "model")
    breaker, phrases = BREAKAGES[breakage]
    breaker(path)
    with pytest.raises(ModelError) as caught:
        load(path, "fp32")
    message = str(caught.value)
    for phrase in phrases:
        assert phrase in message, message
    assert str(path) in message or breakage == "missing-weight", message
    assert "\n" not in message and "Traceback" not in message


def test_load_refuses_a_truncated_weights_file_with_a_model_error(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path / "model")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])  # an interrupted copy or download
    with pytest.raises(ModelError, match="model.safetensors"):
        load(path, "fp32")


def test_load_refuses_an_unknown_dtype_before_loading(tiny_model):
    with pytest.raises(ModelError) as caught:
        load(tiny_model, "fp16")
    assert "'fp16'" in str(caught.value)
    for name in DTYPES:
        assert name in str(caught.value)


def _unfit_parameters(dtype: str, factor: float = 1.3) -> int:
    """A parameter count whose load as ``dtype`` needs ``factor`` x the memory check's budget
    (margins of tens of percent either way, so the free memory moving a little changes nothing)."""
    budget = psutil.virtual_memory().available * 0.9
    per_param = {"fp32": 4.0, "bf16": 2.0, "int8": 2.0, "int4": 2.0}[dtype]  # int8/4 load via bf16
    return int(budget / per_param * factor)


def _suggested(message: str) -> list[str]:
    advice = message.split("try", 1)[1] if "try" in message else ""
    return re.findall(r"\b(bf16|fp32|int8|int4)\b", advice)


def test_check_memory_refuses_a_model_bigger_than_available_memory():
    check_memory(1_000_000, "fp32")  # the tiny ones fit
    params = _unfit_parameters("fp32")
    with pytest.raises(ModelError) as caught:
        check_memory(params, "fp32")
    message = str(caught.value)
    assert "fp32" in message and "GB" in message and "available" in message, message
    suggested = _suggested(message)
    assert suggested, message
    for dtype in suggested:  # what it suggests does fit (bf16 weights are half the size)
        check_memory(params, dtype)


@pytest.mark.parametrize("dtype", [
    "bf16", "int8", "int4"])
def test_check_memory_only_suggests_dtypes_that_fit(dtype):
    params = _unfit_parameters(dtype)
    with pytest.raises(ModelError) as caught:
        check_memory(params, dtype)
    for suggestion in _suggested(str(caught.value)):
        check_memory(params, suggestion)


@pytest.mark.parametrize("flags", [{"avx512f", "avx512_bf16"}, {"amx_bf16", "amx_tile"}])
def test_auto_dtype_is_bf16_with_native_bf16(flags):
    dtype, reason = choose_dtype("auto", flags)
    assert dtype == "bf16"
    assert "bf16" in reason


def test_auto_dtype_is_fp32_without_native_bf16_and_says_what_is_missing():
    dtype, reason = choose_dtype("auto", {"avx2", "fma", "avx512f"})
    assert dtype == "fp32"
    assert "avx512_bf16" in reason and "amx_bf16" in reason


def test_explicit_dtypes_are_taken_as_requested_and_unknown_ones_rejected():
    for name in ("bf16", "fp32", "int8", "int4"):
        assert choose_dtype(name, set()) == (name, "requested")
    for bad in ("fp16", "float32", "", "INT8"):
        with pytest.raises(ModelError, match="unknown dtype"):
            choose_dtype(bad, set())


# -- the loader ----------------------------------------------------------------------------------

def test_loader_gives_the_same_logits_as_transformers(loaded, hf_model, tiny_model):
    assert (loaded.name, loaded.dtype, loaded.dtype_reason) == ("tiny", "fp32", "requested")
    assert loaded.context == 4096
    assert loaded.parameters == sum(p.numel() for p in hf_model.parameters())
    assert loaded.tokenizer.is_fast
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    ids = loaded.tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.inference_mode():
        ours, theirs = loaded.model(ids).logits, hf_model(ids).logits
    assert ours.shape == theirs.shape
    # Same weights, same kernels, same order of operations: equal, up to float noise at most.
    assert (ours - theirs).abs().max().item() <= 1e-6


def test_load_reports_progress_to_the_end(tiny_model):
    seen = []
    load(tiny_model, "fp32", progress=lambda done, total, name: seen.append((done, total, name)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert seen[-1][2] == "model.safetensors"


# -- greedy decoding -----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [PROMPT, "温度 🌡️ café"])
def test_greedy_decoding_matches_transformers_generate(loaded, hf_model, prompt):
    """The KV-cache decode loop against transformers' own greedy ``generate``."""
    n = 40
    generator, recorder = recording(loaded)
    pieces: list[str] = []
    result = generator.generate(prompt, {**GREEDY, "max_new_tokens": n + 1}, pieces.append)
    prompt_ids = generator.encode(prompt)
    # Prefill once, then exactly one new token per step: the cache carries the rest.
    assert recorder.calls[0] == prompt_ids
    assert [len(c) for c in recorder.calls[1:]] == [1] * n
    ours = generated_ids(recorder)

    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None,
                                           pad_token_id=loaded.tokenizer.pad_token_id)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), generation_config=config)
    theirs = out[0, len(prompt_ids):].tolist()
    assert len(theirs) == n
    assert ours == theirs
    if prompt == PROMPT:
        assert len(set(ours)) > 10  # a varied continuation, not one repeated token
    assert result.stats["new_tokens"] == n + 1
    assert result.stats["prompt_tokens"] == len(prompt_ids)
    assert result.stats["finish_reason"] == "length"
    assert result.text.startswith(loaded.tokenizer.decode(theirs, skip_special_tokens=True)
                                  .rstrip("\ufffd"))


def test_greedy_decoding_is_deterministic(loaded):
    runs = []
    for _ in range(2):
        generator, recorder = recording(loaded)
        pieces: list[str] = []
        result = generator.generate(PROMPT, {**GREEDY, "max_new_tokens": 30}, pieces.append)
        runs.append((generated_ids(recorder), result.text, pieces))
    assert runs[0] == runs[1]


# -- weight-only int8 / int4 ---------------------------------------------------------------------

BF16_REL = 2.0 ** -8  # the largest relative rounding error of bf16 (8 significant bits)


@pytest.fixture(scope="module")
def quantised(tiny_model):
    return {kind: load(tiny_model, kind) for kind in ("int8", "int4")}


def _linears(model, kind):
    return {name: m for name, m in model.named_modules() if isinstance(m, kind)}


def _served(module) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel really computes per weight: the module applied to the identity gives
    ``W_served^T + bias`` (in bf16); returned as ``(W_served + bias, bias)``, [out, in]."""
    eye = torch.eye(module.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = module(eye).float().T
    bias = (module.bias.float() if module.bias is not None
            else torch.zeros(module.out_features))[:, None]
    return out, bias


def test_every_linear_is_quantised(quantised, loaded):
    expected = {n for n, m in loaded.model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(_linears(quantised["int8"].model, Int8Linear)) == expected
    assert set(_linears(quantised["int4"].model, Int4Linear)) == expected
    for kind in ("int8", "int4"):
        assert not any(isinstance(m, torch.nn.Linear) for m in quantised[kind].model.modules())
        assert quantised[kind].dtype == kind


def test_int8_weights_are_within_one_quantisation_step(quantised, loaded):
    """Per output channel, step = max|w| / 127; q = round(w / step) errs by <= step/2. The
    scales are stored in bf16 (the kernel wants them so), which adds |q| * |bf16(step) - step|
    <= 127 * 2^-8 * step: so every served weight is within one step, never more."""
    for name, module in _linears(quantised["int8"].model, Int8Linear).items():
        weight = loaded.model.get_submodule(name).weight.detach().float()
        step = weight.abs().amax(dim=1) / 127
        stored = module.scales.float()
        served = module.qweight.float() * stored[:, None]
        bound = step / 2 + 127 * (stored - step).abs() + 1e-9
        assert ((served - weight).abs() <= bound[:, None]).all(), name
        assert ((served - weight).abs() < step.clamp(min=1e-12)[:, None]).all(), name  # 0 rows too
        # The kernel multiplies by exactly that weight: its bf16 output is rounded twice (the
        # product, then the bias added), each time by at most 2^-8 of the magnitude.
        kernel, bias = _served(module)
        rounding = 2 * BF16_REL * (served.abs() + bias.abs()) + 1e-9
        assert ((kernel - (served + bias)).abs() <= rounding).all(), name


def test_int8_weights_err_by_at_most_half_a_step(quantised, loaded):
    for name, module in _linears(quantised["int8"].model, Int8Linear).items():
        weight = loaded.model.get_submodule(name).weight.detach().float()
        served = module.qweight.float() * module.scales.float()[:, None]
        step = module.scales.float()  # the step actually used, (1 +- 2^-8) x max|w| / 127
        assert ((served - weight).abs() <= step[:, None] / 2 * (1 + 1e-3)).all(), name


def test_int4_weights_are_within_half_a_group_step(quantised, loaded):
    """Groups of 32 along the input, asymmetric: step = (max - min) / 15, w ~ q * step + min with
    q in 0..15, so rounding errs by <= step/2. Stored (and served) as ``(q - 8) * scale + zero``
    with scale and zero in bf16: add 8 * |dscale| + |dzero|; the kernel's bf16 arithmetic
    rounds three times (the product, + zero, + bias), each by at most 2^-8 of the magnitude."""
    for name, module in _linears(quantised["int4"].model, Int4Linear).items():
        weight = loaded.model.get_submodule(name).weight.detach().float()
        n, k = weight.shape
        groups = weight.reshape(n, k // INT4_GROUP, INT4_GROUP)
        low = groups.amin(dim=2)
        step = (groups.amax(dim=2) - low) / 15
        zero = low + 8 * step
        stored_step = module.scale_zero[..., 0].float().T  # stored as [groups, n]
        stored_zero = module.scale_zero[..., 1].float().T
        bound = (step / 2 + 8 * (stored_step - step).abs() + (stored_zero - zero).abs())
        kernel, bias = _served(module)
        served = (kernel - bias).reshape(n, k // INT4_GROUP, INT4_GROUP)
        error = (served - groups).abs()
        magnitude = groups.abs() + step[..., None] + bias.reshape(n, 1, 1).abs()
        limit = bound[..., None] + 3 * BF16_REL * magnitude + 1e-9
        assert (error <= limit).all(), f"{name}: worst {(error / step[..., None]).max():.3f} step"


# Logits of weight-only quantised models against the fp32 reference, on TEXT (42 positions).
# Why these tolerances: a linear's output error relative to its output is about
# step_rms / sqrt(12) / weight_rms. For int8 per channel (step = max|w|/127, max|w| ~ 3 sigma)
# that is ~0.7 % per linear, for int4 in groups of 32 (step = range/15 ~ 0.3 sigma) ~8 % (both
# measured on the tiny model's linears: 0.7 % and 8 %). Through two layers plus the head
# (residual connections keep most of it from compounding) the logits' cosine to the reference is
# then ~1 - 1e-4 (int8; measured 0.99993 worst position) and ~1 - 1e-2 (int4; measured 0.989).
# The asserted floors, 0.999 and 0.98, leave margin for other CPUs' kernels and are far above what
# anything broken gives: logits of two different positions of the same text have cosine < 0.7.
# Top-1: the tiny random model's 4000 logits have std 2 and small top-1/top-2 gaps, so int8
# (logit error ~0.02) keeps every argmax while int4 (error ~0.3) flips some; for int4 the
# reference's top token must stay in the top 5.
QUANT_CASES = {
    # kind: (cosine floor, least share of positions with the same argmax, top-5 share)
    "bf16": (0.9999, 0.95, 1.0),
    "int8": (0.999, 0.95, 1.0),
    "int4": (0.98, 0.5, 0.9),
}


@pytest.mark.parametrize("kind", list(QUANT_CASES))
def test_quantised_logits_are_close_to_the_fp32_reference(kind, tiny_model, quantised,
                                                          reference_logits):
    ids, reference = reference_logits
    model = (quantised[kind] if kind in quantised else load(tiny_model, kind)).model
    with torch.inference_mode():
        logits = model(ids).logits[0, :, :reference.shape[-1]].float()
    floor, top1_share, top5_share = QUANT_CASES[kind]
    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    assert cosine.min().item() > floor, cosine
    same = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert same >= top1_share, same
    top5 = torch.topk(logits, 5, dim=-1).indices
    kept = (top5 == reference.argmax(-1, keepdim=True)).any(-1).float().mean().item()
    assert kept >= top5_share, kept
    # The floor discriminates: different positions of the reference are far apart.
    apart = torch.nn.functional.cosine_similarity(reference[:-1], reference[1:], dim=-1)
    assert apart.max().item() < floor - 0.1


def test_quantised_models_generate(quantised):
    for kind, model in quantised.items():
        result = Generator(model).generate(PROMPT, {**GREEDY, "max_new_tokens": 8})
        assert result.stats["new_tokens"] == 8 and result.stats["dtype"] == kind


# -- sampling ------------------------------------------------------------------------------------

def _ids(loaded, options: dict) -> list[int]:
    generator, recorder = recording(loaded)
    generator.generate(PROMPT, {"ignore_eos": True, "max_new_tokens": 25, **options})
    return generated_ids(recorder)


def test_sampling_with_a_seed_is_reproducible(loaded):
    first = _ids(loaded, {"seed": 7})
    assert _ids(loaded, {"seed": 7}) == first
    assert _ids(loaded, {"seed": 8}) != first
    assert first != _ids(loaded, {"greedy": True})


def test_temperature_zero_and_a_tiny_top_p_are_greedy(loaded):
    greedy = _ids(loaded, {"greedy": True})
    assert _ids(loaded, {"temperature": 0.0, "seed": 3}) == greedy
    assert _ids(loaded, {"temperature": 0.6, "top_p": 1e-6, "seed": 3}) == greedy
    assert _ids(loaded, {"temperature": 1.5, "top_p": 1e-6, "seed": 4}) == greedy


# -- chat template and streaming text ------------------------------------------------------------

def test_prompt_is_rendered_in_the_r1_chat_template(loaded, tokenizer):
    generator = Generator(loaded)
    ids = generator.encode("hi")
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n")
    special = synth.special_ids()
    assert ids == ([special[synth.BOS], special[synth.USER]]
                   + tokenizer.encode("hi", add_special_tokens=False)
                   + [special[synth.ASSISTANT], special[synth.THINK]]
                   + tokenizer.encode("\n", add_special_tokens=False))
    assert ids.count(special[synth.BOS]) == 1


REASONING = "Let me think.\n2 + 2 is 4 < 5, and a </b> tag is not </think-ish>.\n"
ANSWER = "\n\n**4** </thin k> <"


def _split(pieces: list[str]) -> tuple[ThinkSplitter, str, str]:
    splitter = ThinkSplitter()
    out = []
    for piece in pieces:
        out += splitter.feed(piece)
    out += splitter.finish()
    assert all(text for _, text in out)
    return (splitter, "".join(t for k, t in out if k == "reasoning"),
            "".join(t for k, t in out if k == "answer"))


def test_think_split_at_every_cut_position():
    text = REASONING + "</think>" + ANSWER
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            splitter, reasoning, answer = _split([text[:i], text[i:j], text[j:]])
            assert (reasoning, answer) == (REASONING, ANSWER), (i, j)
            assert splitter.reasoning_text == REASONING.strip()
            assert splitter.answer_text == ANSWER.strip()


def test_think_split_one_character_at_a_time_and_without_a_close_tag():
    splitter, reasoning, answer = _split(list(REASONING + "</think>" + ANSWER))
    assert (reasoning, answer) == (REASONING, ANSWER)
    splitter, reasoning, answer = _split([REASONING, "</thi"])  # cut off mid-tag: all reasoning
    assert (reasoning, answer) == (REASONING + "</thi", "")


# Text made of tag fragments, so that near-tags and partial tags are common.
_TAGGY = st.lists(st.sampled_from(list("<>/thinkTHINK \n.ab4") + ["</think", "<think", "</", "k>"]),
                  max_size=25).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reasoning=_TAGGY.filter(lambda s: "</think>" not in s),
       answer=_TAGGY.filter(lambda s: "<think>" not in s),
       cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=8))
def test_think_split_property(reasoning, answer, cuts):
    text = reasoning + "</think>" + answer
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    splitter, got_reasoning, got_answer = _split(pieces)
    assert (got_reasoning, got_answer) == (reasoning, answer)
    assert splitter.reasoning_text == reasoning.strip()
    assert splitter.answer_text == answer.strip()


def _stream(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    decoder = IncrementalDecoder(lambda t: tokenizer.decode(t, skip_special_tokens=False))
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


MULTIBYTE = "温度 🌡️ café — naïve 日本語のテキスト 👩‍👩‍👧 Ωmega ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"


def test_incremental_decoding_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    # The tiny tokenizer spreads these characters over several byte-level tokens each.
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(1, len(ids)))
    pieces, rest = _stream(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # something was held back until its character was complete
    assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens=False)
    assert rest == ""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
                    max_size=30)
       | st.lists(st.sampled_from(["温", "度", "🌡️", "é", "👩‍👧", "𝔘", " ", "a", "\n", "—"]),
                  max_size=20).map("".join))
def test_incremental_decoding_property(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    pieces, rest = _stream(tokenizer, ids)
    assert "".join(pieces) + rest == whole
    if "\ufffd" not in whole:
        assert not any("\ufffd" in p for p in pieces)
        assert rest == ""


def test_streamed_text_is_the_raw_text_with_the_think_tag(tiny_model, tmp_path, loaded):
    """The pieces handed to ``on_text`` are the decoded ids, special tokens and tags included;
    the result's text leaves out special tokens."""
    eos_model = forced_token_model(tiny_model, tmp_path / "eos", loaded.tokenizer.eos_token_id)
    generator = Generator(load(eos_model, "fp32"))
    pieces: list[str] = []
    result = generator.generate("hi", {"greedy": True, "ignore_eos": True, "max_new_tokens": 3},
                                pieces.append)
    assert "".join(pieces) == synth.EOS * 3
    assert result.text == "" and result.stats["new_tokens"] == 3


# -- limits, eos and cancel ----------------------------------------------------------------------

def test_max_new_tokens_is_respected(loaded):
    generator, recorder = recording(loaded)
    result = generator.generate(PROMPT, {**GREEDY, "max_new_tokens": 7})
    assert result.stats["new_tokens"] == 7 and result.stats["finish_reason"] == "length"
    assert len(recorder.calls) == 7  # the prefill and six decode steps: no wasted forward pass
    result = Generator(loaded).generate(PROMPT, {"seed": 1, "max_new_tokens": 5})
    assert result.stats["new_tokens"] <= 5


def test_generation_stops_at_eos(tiny_model, tmp_path, loaded):
    eos_model = forced_token_model(tiny_model, tmp_path / "eos", loaded.tokenizer.eos_token_id)
    generator = Generator(load(eos_model, "fp32"))
    result = generator.generate("hi", {"greedy": True, "max_new_tokens": 50})
    assert result.stats["finish_reason"] == "eos"
    assert result.stats["new_tokens"] == 0 and result.text == ""


def test_a_prompt_longer_than_the_context_is_refused_before_any_work(loaded):
    generator, recorder = recording(loaded)
    prompt = "hello there " * 3000
    prompt_tokens = len(generator.encode(prompt))
    assert prompt_tokens > loaded.context
    with pytest.raises(InvalidRequest) as caught:
        generator.generate(prompt, {"max_new_tokens": 1})
    message = str(caught.value)
    assert str(prompt_tokens) in message and str(loaded.context) in message, message
    # A short prompt whose max_new_tokens would run past the context is refused as well.
    with pytest.raises(InvalidRequest) as caught:
        generator.generate("hi", {"max_new_tokens": loaded.context})
    assert str(loaded.context) in str(caught.value)
    assert recorder.calls == []


def test_cancel_stops_generation(loaded):
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) >= 5

    pieces: list[str] = []
    result = Generator(loaded).generate(PROMPT, {**GREEDY, "max_new_tokens": 4000},
                                        pieces.append, cancelled=cancelled)
    assert result.stats["finish_reason"] == "cancelled"
    assert 1 <= result.stats["new_tokens"] <= 6
    assert len(asked) == 5


# -- request options -----------------------------------------------------------------------------

@pytest.mark.parametrize("options, key", [
    ({"bogus": 1}, "bogus"),
    ({"max_tokens": 10}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"greedy": 1}, "greedy"),
    ({"seed": "7"}, "seed"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"seed": -1}, "seed"),
])
def test_bad_options_are_rejected(options, key):
    with pytest.raises(InvalidArgument) as caught:
        validate_options(options)
    assert repr(key) in str(caught.value), str(caught.value)


def test_good_options_pass_and_integers_become_floats():
    clean = validate_options({"max_new_tokens": 20, "temperature": 1, "top_p": 1, "greedy": True,
                              "ignore_eos": False, "seed": 0})
    assert clean == {"max_new_tokens": 20, "temperature": 1.0, "top_p": 1.0, "greedy": True,
                     "ignore_eos": False, "seed": 0}
    assert isinstance(clean["temperature"], float)
    assert validate_options({}) == {}
