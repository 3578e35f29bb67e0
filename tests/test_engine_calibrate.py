"""Flash attention and the KV cache's type measured once per model, build and machine
(``engine_flash_attn = auto``, ``engine_kv_type = auto``), the fastest kept and said; a forced
choice and a q8_0 KV cache reach llama-server as flags."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from engine_fixtures import ENGINE, ENGINE_PATH, engine_daemon_running  # noqa: E402

from dsr1d.edges.engine_calibrate import FILE, candidates, choose  # noqa: E402

pytest_plugins = ["daemon_fixtures", "engine_fixtures"]


def server_args(daemon) -> list[str]:
    (server,) = [p for p in psutil.Process(daemon.daemon.pid).children(recursive=True)
                 if p.name() == "llama-server"]
    return server.cmdline()


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_auto_leaves_open_only_what_is_not_configured() -> None:
    assert candidates("auto", "auto") == [("on", "f16"), ("off", "f16"), ("on", "q8_0")]
    assert candidates("auto", "f16") == [("on", "f16"), ("off", "f16")]
    assert candidates("auto", "q8_0") == [("on", "q8_0"), ("off", "q8_0")]
    assert candidates("on", "auto") == [("on", "f16"), ("on", "q8_0")]
    assert candidates("off", "q8_0") == [("off", "q8_0")]


def test_the_fastest_way_is_kept_and_a_tie_keeps_the_earlier() -> None:
    on, off, q8 = ("on", "f16"), ("off", "f16"), ("on", "q8_0")
    assert choose({on: [20.0, 21.0], off: [25.0, 24.0]})[0] == off
    assert choose({on: [25.0, 24.0], off: [20.0, 21.0]})[0] == on
    assert choose({on: [20.0, 20.0], off: [20.2, 20.3], q8: [20.3, 20.3]})[0] == on
    pick, why = choose({on: [18.4, 18.4], off: [17.3, 17.3], q8: [21.4, 21.4]})
    assert pick == q8
    assert why == ("decode 18.4 tok/s with flash attention on, KV cache f16, 17.3 tok/s with "
                   "flash attention off, KV cache f16, 21.4 tok/s with flash attention on, "
                   "KV cache q8_0")


def test_auto_measures_once_and_serves_the_fastest(smollm2: Path, tmp_path: Path) -> None:
    config = ["engine_context = 1024", "engine_flash_attn = auto", "engine_kv_type = auto"]
    with engine_daemon_running(tmp_path / "first", smollm2, extra_config=config) as daemon:
        daemon.wait_state("ready")
        log = daemon.daemon.log()
        args = server_args(daemon)
    (entry,) = json.loads((tmp_path / "first/cache" / FILE).read_text()).values()
    assert sorted(entry["rates"]) == ["flash attention off, KV cache f16",
                                      "flash attention on, KV cache f16",
                                      "flash attention on, KV cache q8_0"]
    assert all(len(rates) == 2 and all(rate > 0 for rate in rates)
               for rates in entry["rates"].values())
    fa, kv = entry["flash_attn"], entry["kv_type"]
    assert flag(args, "--flash-attn") == fa
    assert flag(args, "--cache-type-k") == (None if kv == "f16" else kv)
    assert flag(args, "--cache-type-v") == (None if kv == "f16" else kv)
    assert f"flash attention {fa}, KV cache {kv}: decode" in log and "(measured now)" in log
    # the same cache on the next start: read, not measured again
    (tmp_path / "second").mkdir()
    (tmp_path / "first/cache").rename(tmp_path / "second/cache")
    with engine_daemon_running(tmp_path / "second", smollm2, extra_config=config) as daemon:
        daemon.wait_state("ready")
        assert "measuring decode" not in daemon.daemon.log()
        assert f"(measured {entry['when']})" in daemon.daemon.log()
        assert flag(server_args(daemon), "--flash-attn") == fa
        assert flag(server_args(daemon), "--cache-type-k") == (None if kv == "f16" else kv)


def test_a_q8_0_cache_without_flash_attention_quantises_k_only(smollm2: Path,
                                                              tmp_path: Path) -> None:
    with engine_daemon_running(tmp_path, smollm2,
                               extra_config=["engine_context = 1024", "engine_flash_attn = off",
                                             "engine_kv_type = q8_0"]) as daemon:
        daemon.wait_state("ready")
        args = server_args(daemon)
        assert flag(args, "--flash-attn") == "off"
        assert flag(args, "--cache-type-k") == "q8_0" and "--cache-type-v" not in args
        assert "K q8_0, V f16" in daemon.daemon.log()
        reply = daemon.client().call("Generate", "sa{sv}", "Hello", {}, interface=ENGINE,
                                     path=ENGINE_PATH)
        assert reply.error_name is None, reply.body
