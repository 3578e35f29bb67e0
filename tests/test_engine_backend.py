"""What a model is prepared as for llama-server, and the GGUF conversion cache (a partial or
stale entry is never
served), on the tiny synthetic model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsr1d.core.config import load_config
from dsr1d.engine.backend import gguf_dtype, is_gguf
from dsr1d.engine.errors import ModelError
from dsr1d.engine.gguf_cache import (cached_gguf, entry_path, source_files, source_key,
                                     valid_entry)
from dsr1d.core.profiles import ProfileError
from dsr1d.engine.gguf_convert import convert
from dsr1d.engine.synth import synthesize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize("tiny", tmp_path_factory.mktemp("tiny") / "tiny-r1")


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


# -- selection ------------------------------------------------------------------------------

def test_a_gguf_file_is_recognised_by_its_magic_whatever_its_name(tmp_path: Path) -> None:
    odd = tmp_path / "weights.bin"
    odd.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert is_gguf(odd)
    other = tmp_path / "other.bin"
    other.write_bytes(b"PK\x03\x04")
    assert not is_gguf(other)
    assert not is_gguf(tmp_path)


def test_a_model_prepared_for_llama_server_is_the_file_or_its_conversion(
        tiny: Path, tmp_path: Path) -> None:
    """What the engine's preparation process reports: a GGUF file as it is, an HF directory
    converted once into the cache; a missing model is one clear line."""
    from io import BytesIO

    from dsr1d import engine_messages as messages
    from dsr1d.engine.prepare import prepare

    out = BytesIO()
    first = prepare(tiny, "int8", tmp_path / "cache", 0, 1, out)
    assert isinstance(first, messages.Prepared), first
    assert Path(first.gguf).parent == tmp_path / "cache" and first.file_type == "int8"
    assert first.thinks and first.context == 4096     # R1's template; the tiny model's context
    again = prepare(Path(first.gguf), "auto", tmp_path / "cache", 0, 1, BytesIO())
    assert isinstance(again, messages.Prepared) and again.gguf == first.gguf
    progress = [messages.decode(line) for line in out.getvalue().splitlines()]
    assert any(isinstance(m, messages.Progress) for m in progress)
    missing = prepare(tmp_path / "nothing.gguf", "auto", tmp_path / "cache", 0, 1, BytesIO())
    assert isinstance(missing, messages.Failed) and "nothing.gguf" in missing.message


def test_auto_precision_for_a_conversion_keeps_the_checkpoints_bf16() -> None:
    assert gguf_dtype("auto") == "bf16"
    assert gguf_dtype("int4") == "int4"


def test_the_backend_is_a_config_key_and_a_profile_key(tmp_path: Path) -> None:
    conf = tmp_path / "dsr1d.conf"
    conf.write_text("[daemon]\nengine_backend = llamacpp\nengine_cache_dir = /var/tmp/x\n")
    config = load_config(conf)
    assert (config.engine_backend, config.engine_cache_dir) == ("llamacpp", "/var/tmp/x")
    conf.write_text("[daemon]\nengine_backend = torch\n")   # the reference, not a server
    with pytest.raises(ProfileError, match=r"dsr1d.conf:2: \[daemon\] engine_backend"):
        load_config(conf)


# -- the conversion cache -------------------------------------------------------------------

def _convert_counting(calls: list[str]):
    def run(src: Path, out: Path, dtype: str, progress=None) -> Path:
        calls.append(dtype)
        return convert(src, out, dtype, progress)
    return run


def test_a_conversion_is_made_once_and_then_served_from_the_cache(tiny: Path,
                                                                   tmp_path: Path) -> None:
    calls: list[str] = []
    cache = tmp_path / "cache"
    first = cached_gguf(tiny, "int8", cache, _convert_counting(calls))
    again = cached_gguf(tiny, "int8", cache, _convert_counting(calls))
    assert first == again and calls == ["int8"]
    assert first.name == f"tiny-r1-{source_key(tiny)}-int8.gguf"
    assert valid_entry(first, source_key(tiny), "int8") is None


def test_an_entry_without_its_manifest_is_a_partial_one_and_is_converted_again(
        tiny: Path, tmp_path: Path) -> None:
    calls: list[str] = []
    cache = tmp_path / "cache"
    entry = cached_gguf(tiny, "int4", cache, _convert_counting(calls))
    entry.with_suffix(".json").unlink()
    assert "interrupted" in valid_entry(entry, source_key(tiny), "int4")
    cached_gguf(tiny, "int4", cache, _convert_counting(calls))
    assert calls == ["int4", "int4"]


def test_a_truncated_entry_is_never_served(tiny: Path, tmp_path: Path) -> None:
    calls: list[str] = []
    cache = tmp_path / "cache"
    entry = cached_gguf(tiny, "bf16", cache, _convert_counting(calls))
    size = entry.stat().st_size
    with entry.open("r+b") as f:
        f.truncate(size // 2)
    assert valid_entry(entry, source_key(tiny), "bf16") is not None
    served = cached_gguf(tiny, "bf16", cache, _convert_counting(calls))
    assert calls == ["bf16", "bf16"] and served.stat().st_size == size


def test_an_entry_cut_short_but_with_a_matching_manifest_size_fails_the_header_check(
        tiny: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    entry = cached_gguf(tiny, "bf16", cache, convert)
    with entry.open("r+b") as f:
        f.truncate(entry.stat().st_size // 3)
    manifest = entry.with_suffix(".json")
    data = json.loads(manifest.read_text())
    data["size"] = entry.stat().st_size
    manifest.write_text(json.dumps(data))
    assert valid_entry(entry, source_key(tiny), "bf16") is not None


def test_a_changed_model_gets_a_new_entry_and_the_stale_one_is_removed(tmp_path: Path) -> None:
    src = synthesize("tiny", tmp_path / "m")
    cache = tmp_path / "cache"
    old = cached_gguf(src, "int8", cache, convert)
    other_dtype = cached_gguf(src, "int4", cache, convert)
    synthesize("tiny", src, seed=1)  # new weights, same path
    new = cached_gguf(src, "int8", cache, convert)
    assert new != old
    assert not old.exists() and not old.with_suffix(".json").exists()
    assert not other_dtype.exists()
    assert sorted(p.name for p in cache.glob("*.gguf")) == [new.name]


def test_a_same_named_other_model_is_left_alone(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    a = cached_gguf(synthesize("tiny", tmp_path / "a" / "m"), "int8", cache, convert)
    b = cached_gguf(synthesize("tiny", tmp_path / "b" / "m", seed=3), "int8", cache, convert)
    assert a.exists() and b.exists() and a != b


def test_digests_are_remembered_and_a_touched_file_is_hashed_again(tiny: Path,
                                                                    tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    key = source_key(tiny, cache)
    memo = json.loads((cache / "digests.json").read_text())
    assert len(memo) == len(source_files(tiny)) >= 4  # config, tokenizer files, weights
    weights = next(tiny.glob("*.safetensors"))
    os.utime(weights, ns=(1, 1))
    assert source_key(tiny, cache) == key  # same content, new stamp: same key
    assert len(json.loads((cache / "digests.json").read_text())) == len(memo) + 1


def test_an_unwritable_cache_is_a_model_error(tiny: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ModelError, match="cannot create the conversion cache"):
        cached_gguf(tiny, "int8", blocker / "cache", convert)


def test_entry_names_are_confined_to_the_cache(tmp_path: Path) -> None:
    entry = entry_path(Path("/models/../weird name!"), "0" * 16, "int8", tmp_path)
    assert entry.parent == tmp_path and "/" not in entry.name


# -- memory under a cgroup limit ------------------------------------------------------------

def _cgroup(tmp_path: Path, limits: dict[str, tuple[str, int]]) -> tuple[Path, Path]:
    fs = tmp_path / "cgroup"
    for rel, (limit, current) in limits.items():
        group = fs / rel
        group.mkdir(parents=True, exist_ok=True)
        (group / "memory.max").write_text(limit + "\n")
        (group / "memory.current").write_text(f"{current}\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/system.slice/dsr1d.service\n")
    return proc, fs


def test_the_tightest_cgroup_limit_on_the_way_up_is_the_room_left(tmp_path: Path) -> None:
    from dsr1d.engine.memory import cgroup_room

    proc, fs = _cgroup(tmp_path, {"system.slice": ("5000", 1000),
                                  "system.slice/dsr1d.service": ("3000", 2500)})
    assert cgroup_room(proc, fs) == 500
    proc, fs = _cgroup(tmp_path / "b", {"system.slice": ("5000", 4800),
                                        "system.slice/dsr1d.service": ("max", 100)})
    assert cgroup_room(proc, fs) == 200


def test_no_cgroup_limit_means_no_room_figure(tmp_path: Path) -> None:
    from dsr1d.engine.memory import cgroup_room

    proc, fs = _cgroup(tmp_path, {"system.slice/dsr1d.service": ("max", 100)})
    assert cgroup_room(proc, fs) is None
    assert cgroup_room(tmp_path / "missing", fs) is None


def test_leftovers_of_a_dead_conversion_are_cleaned_but_a_live_ones_kept(tiny: Path,
                                                                        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = cache / ".tiny-r1-0123456789abcdef-int8.gguf.999999999.partial"
    live = cache / f".other.gguf.{os.getpid()}.partial"
    dead.write_bytes(b"GGUF")
    live.write_bytes(b"GGUF")
    cached_gguf(tiny, "int8", cache, convert)
    assert not dead.exists() and live.exists()


# -- a Hugging Face hub cache folder ----------------------------------------------------------

def _hub_cache(tmp_path: Path, snapshots: list[str], ref: str | None) -> Path:
    folder = tmp_path / "models--deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B"
    for name in snapshots:
        (folder / "snapshots" / name).mkdir(parents=True)
    if ref is not None:
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(ref + "\n")
    return folder


def test_a_hub_cache_folder_is_pointed_at_the_snapshot_refs_main_names(tmp_path: Path) -> None:
    from dsr1d.engine.backend import model_name, resolve_model

    folder = _hub_cache(tmp_path, ["aaa111", "bbb222"], ref="bbb222")
    snapshot = resolve_model(folder)
    assert snapshot == folder / "snapshots" / "bbb222"
    assert model_name(snapshot) == "DeepSeek-R1-Distill-Qwen-1.5B"


def test_a_hub_cache_folder_with_one_snapshot_and_no_ref_uses_it(tmp_path: Path) -> None:
    from dsr1d.engine.backend import resolve_model

    folder = _hub_cache(tmp_path, ["ccc333"], ref=None)
    assert resolve_model(folder).name == "ccc333"


def test_an_ambiguous_hub_cache_folder_lists_its_snapshots(tmp_path: Path) -> None:
    from dsr1d.engine.backend import resolve_model

    folder = _hub_cache(tmp_path, ["aaa111", "bbb222"], ref=None)
    with pytest.raises(ModelError, match="snapshots.*aaa111, bbb222"):
        resolve_model(folder)


def test_other_models_resolve_to_themselves_and_are_named_by_their_file(tmp_path: Path) -> None:
    from dsr1d.engine.backend import model_name, resolve_model

    gguf = tmp_path / "r1-7b-Q4_K_M.gguf"
    assert resolve_model(gguf) == gguf and model_name(gguf) == "r1-7b-Q4_K_M"
    assert model_name(tmp_path) == tmp_path.name


def test_a_snapshot_converts_under_its_repository_name(tmp_path: Path) -> None:
    folder = _hub_cache(tmp_path, [], ref=None)
    snapshot = synthesize("tiny", folder / "snapshots" / "0123abcd")
    entry = cached_gguf(snapshot, "int8", tmp_path / "cache", convert)
    assert entry.name.startswith("DeepSeek-R1-Distill-Qwen-1.5B-")
    from dsr1d.engine.gguf_file import inspect_gguf

    assert inspect_gguf(entry).name == "DeepSeek-R1-Distill-Qwen-1.5B"
