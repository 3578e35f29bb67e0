"""The synthetic R1-Distill-Qwen model: a real, loadable Hugging Face directory (tiny preset)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub read it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dsr1d.engine import synth  # noqa: E402

USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth.synthesize("tiny", tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return transformers.AutoTokenizer.from_pretrained(str(tiny), local_files_only=True)


@pytest.fixture(scope="module")
def model(tiny):
    # transformers 5: `dtype=` (`torch_dtype=` still works but logs a deprecation), and the
    # default is now the checkpoint's dtype ("auto"), not float32.
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32,
                                                             local_files_only=True)


def test_directory_has_the_real_checkpoint_files(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"}


def test_config_matches_the_preset(tiny, model, tokenizer):
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 192, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.hidden_size // cfg.num_attention_heads == 16
    assert cfg.intermediate_size % 64 == 0
    assert cfg.max_position_embeddings == 4096
    assert cfg.vocab_size == 4032 and cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tokenizer)
    assert cfg.tie_word_embeddings is False and cfg.use_sliding_window is False
    assert cfg.rope_parameters["rope_theta"] == 10000
    assert cfg.bos_token_id == tokenizer.bos_token_id
    assert cfg.eos_token_id == tokenizer.eos_token_id
    assert raw["torch_dtype"] == "bfloat16"
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert (gen["do_sample"], gen["temperature"], gen["top_p"]) == (True, 0.6, 0.95)
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (tokenizer.bos_token_id,
                                                         tokenizer.eos_token_id)


def test_weights_are_bf16_with_unit_norms(tiny):
    from safetensors import safe_open
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert torch.equal(f.get_tensor("model.norm.weight"), torch.ones(64, dtype=torch.bfloat16))
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float()
        assert 0.015 < q.std().item() < 0.025


def test_forward_gives_finite_logits(model, tokenizer):
    ids = tokenizer("Two cores read about 41 GB/s.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # Rows past the tokenizer are zero, so a greedy step never picks an undecodable id.
    assert logits[0, :, len(tokenizer):].abs().max().item() == 0.0
    assert logits[0, -1, :len(tokenizer)].std().item() > 0.5


def test_greedy_generation_runs(model, tokenizer):
    ids = tokenizer.apply_chat_template(USER_HI, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    new = out[0, ids.shape[1]:]
    assert 1 <= len(new) <= 8 and int(new.max()) < len(tokenizer)


def test_tokenizer_is_fast_and_about_4000_tokens(tokenizer):
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast) and tokenizer.is_fast
    assert len(tokenizer) == synth.tokenizer_size() == 4000


def test_chat_template_is_r1s(tokenizer):
    text = tokenizer.apply_chat_template(USER_HI, add_generation_prompt=True, tokenize=False)
    # The real template prepends bos_token itself.
    assert text == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
    ids = tokenizer.apply_chat_template(USER_HI, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<｜User｜>")]
    assert ids.count(tokenizer.bos_token_id) == 1
    turn = [*USER_HI, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"}]
    text = tokenizer.apply_chat_template(turn, tokenize=False)
    assert text.endswith("<｜Assistant｜>\n\nHello!<｜end▁of▁sentence｜>")  # reasoning dropped


@pytest.mark.parametrize("token", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                   "<｜Assistant｜>", "<think>", "</think>"])
def test_special_tokens_are_single_ids_that_round_trip(tokenizer, token):
    ids = tokenizer(token, add_special_tokens=False).input_ids
    assert len(ids) == 1
    assert tokenizer.convert_ids_to_tokens(ids[0]) == token
    assert tokenizer.decode(ids) == token
    assert ids[0] == synth.special_ids()[token]


def test_special_token_roles(tokenizer):
    assert tokenizer.bos_token == "<｜begin▁of▁sentence｜>"
    assert tokenizer.eos_token == tokenizer.pad_token == "<｜end▁of▁sentence｜>"
    assert tokenizer("hi").input_ids[0] == tokenizer.bos_token_id  # add_bos_token, as in R1
    # As in R1's tokenizer, the think tags are not "special": skip_special_tokens keeps them.
    ids = tokenizer("<think>\nok\n</think>\n\nyes").input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nok\n</think>\n\nyes"


@pytest.mark.parametrize("text", [
    "naïve café, Straße, façade — “quotes” … ½ °C",
    "大型语言模型 日本語のテキスト 한국어 ไทย العربية",
    "emoji 😀🚀🔥 👩‍💻 🇫🇷 and a rare one: 🦩 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n\treturn x ** 2  # tabs,\r\n  spaces   and\n\n\nnewlines",
])
def test_multibyte_text_round_trips(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert max(ids) < len(tokenizer)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny):
    again = synth.synthesize("tiny", tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    synth._tokenizer_json.cache_clear()  # retrain the BPE: training is deterministic too
    assert synth._tokenizer_json() == (tiny / "tokenizer.json").read_text(encoding="utf-8")
    other = synth.synthesize("tiny", tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_float32_is_the_same_model(tmp_path, tiny):
    from safetensors.torch import load_file
    fp32 = load_file(str(synth.synthesize("tiny", tmp_path / "fp32", dtype="float32")
                         / "model.safetensors"))
    bf16 = load_file(str(tiny / "model.safetensors"))
    assert fp32["lm_head.weight"].dtype == torch.float32
    for name, tensor in bf16.items():
        assert torch.equal(fp32[name].to(torch.bfloat16), tensor), name


def test_1_5b_config_has_the_published_parameter_count():
    config = synth.model_config("1.5b")
    for key, value in {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                       "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                       "max_position_embeddings": 131072, "rope_theta": 10000,
                       "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                       "sliding_window": 4096, "use_sliding_window": False,
                       "torch_dtype": "bfloat16"}.items():
        assert config[key] == value, key
    hf_config = transformers.Qwen2Config.from_dict(config)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf_config)
    counted = sum(p.numel() for p in meta.parameters())
    assert counted == synth.parameter_count(config) == 1_777_088_000
    shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    assert shapes == {s.name: s.shape for s in synth.tensor_specs(config)}
    assert synth.weight_bytes("1.5b") == 2 * counted


def test_7b_config_is_the_published_one():
    config = synth.model_config("7b")
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"],
            config["vocab_size"]) == (3584, 18944, 28, 28, 4, 152064)
    assert 7.5e9 < synth.parameter_count(config) < 7.7e9


def test_big_presets_are_sharded_under_2gb():
    config = synth.model_config("1.5b")
    files = synth._plan_files(synth.tensor_specs(config), 2)
    assert [name for name, _ in files] == ["model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors"]
    assert all(sum(s.numel for s in specs) * 2 <= synth.MAX_SHARD_BYTES for _, specs in files)


def test_sharded_writer_produces_a_loadable_index(tmp_path, monkeypatch):
    # The 2 GB shard limit shrunk so that the tiny model is written like a big one.
    monkeypatch.setattr(synth, "SINGLE_FILE_BYTES", 100_000)
    monkeypatch.setattr(synth, "MAX_SHARD_BYTES", 400_000)
    seen = []
    out = synth.synthesize("tiny", tmp_path / "sharded", progress=lambda *a: seen.append(a))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == synth.weight_bytes("tiny")
    assert seen[-1] == (synth.weight_bytes("tiny"), synth.weight_bytes("tiny"), "lm_head.weight")
    assert [a[0] for a in seen] == sorted(a[0] for a in seen)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    # Re-writing it as one file removes the shards and the index.
    monkeypatch.undo()
    synth.synthesize("tiny", out)
    assert [p.name for p in out.glob("model*")] == ["model.safetensors"]


def test_bad_preset_and_dtype_are_errors(tmp_path):
    with pytest.raises(synth.SynthError, match="unknown preset"):
        synth.synthesize("70b", tmp_path / "x")
    with pytest.raises(synth.SynthError, match="unknown dtype"):
        synth.synthesize("tiny", tmp_path / "x", dtype="float16")


def test_not_enough_disk_is_a_clear_error(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**9, 10**9))
    with pytest.raises(synth.SynthError, match="not enough free disk space.*needs 3.6 GB"):
        synth.synthesize("1.5b", tmp_path / "big")
    assert not (tmp_path / "big").exists()


def test_cli_refuses_a_non_empty_dir_without_force(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert synth.synth_main(["--preset", "tiny", str(out)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert synth.synth_main(["--preset", "tiny", "--seed", "3", "--force", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "parameters" in summary and "seed 3" in summary
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["dsr1d_synthetic"]["seed"] == 3


def test_cli_progress_lines(capsys):
    report = synth._cli_progress(synth.model_config("1.5b"))
    report(3 * 10**8, 3_554_176_000, "model.layers.2.mlp.down_proj.weight")
    report(3 * 10**8, 3_554_176_000, "model.layers.3.mlp.up_proj.weight")  # not a step's end
    assert capsys.readouterr().err == "[ 4/30] 0.3/3.6 GB model.layers.2\n"
