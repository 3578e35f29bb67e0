"""Supervision that never gives up, on the real daemon and a private bus: a result larger than
any line limit arrives whole, a hung worker is killed and replaced with its caller answered and
the engine's hold released, and a model that cannot load ends in ``failed`` with the reason —
after one try when the failure is in the model, after a bounded number of deaths otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import ERROR, eventually, prop  # noqa: E402
from engine_fixtures import (copy_model, engine, engine_async,  # noqa: E402
                             engine_daemon_running, forced_token_model, options, reply_of,
                             worker_of)

pytest_plugins = ["engine_fixtures"]

from dbus_fast import MessageType  # noqa: E402

LONG_PIECE = " multiplications"  # the tiny tokenizer's longest token: 16 characters


@pytest.fixture(scope="module")
def long_output_gguf(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF whose greedy output repeats LONG_PIECE, with an 8192-token context: 5,000 tokens
    are 80,000 characters, past asyncio's default 64 KiB line limit."""
    from tokenizers import Tokenizer

    from dsr1d.engine.gguf_convert import convert

    work = tmp_path_factory.mktemp("long")
    (token,) = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(
        LONG_PIECE, add_special_tokens=False).ids
    model = forced_token_model(tiny_model, work / "forced", token)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    return convert(model, work / "long.gguf", "int8")


def test_a_result_over_64_kib_arrives_whole(long_output_gguf: Path, tmp_path: Path) -> None:
    with engine_daemon_running(tmp_path, long_output_gguf, backend="llamacpp") as served:
        served.wait_state("ready")
        call = engine_async(served.client(), "Generate", "sa{sv}", "hi",
                            options(greedy=True, ignore_eos=True, max_new_tokens=5000))
        reply = reply_of(call, "the Generate reply", timeout=120)
        assert reply.message_type == MessageType.METHOD_RETURN, reply.body
        text, stats = reply.body[0], {k: v.value for k, v in reply.body[1].items()}
        assert text == LONG_PIECE * 5000 and len(text) > 65536
        assert stats["new_tokens"] == 5000 and stats["reasoning_chars"] == len(text.strip())
        assert served.engine_prop("State") == "ready"
        assert "killing it" not in served.daemon.log()


def test_a_hung_worker_is_killed_its_caller_answered_and_the_engine_replaced(
        long_output_gguf: Path, tmp_path: Path) -> None:
    with engine_daemon_running(tmp_path, long_output_gguf, backend="llamacpp",
                               extra_config=["engine_ping_timeout_s = 3"]) as served:
        served.wait_state("ready")
        client = served.client()
        call = engine_async(client, "Generate", "sa{sv}", "hi",
                            options(greedy=True, ignore_eos=True, max_new_tokens=8000))
        worker = worker_of(served)
        eventually(lambda: served.engine_prop("State") == "busy", what="the job running")
        assert prop(served.bus, "Holds"), "the engine holds its profile while it generates"
        os.kill(worker.pid, signal.SIGSTOP)
        reply = reply_of(call, "the Generate reply after the hang", timeout=20)
        assert reply.error_name == ERROR + "EngineUnavailable", reply.body
        assert "stopped answering pings" in served.daemon.log()
        eventually(lambda: prop(served.bus, "Holds") == [], what="the engine's hold released")
        served.wait_state("ready", timeout=30)
        assert worker_of(served).pid != worker.pid
        again = engine(client, "Generate", "sa{sv}", "hi", options(greedy=True, max_new_tokens=3))
        assert again.error_name is None, again.body


def test_a_model_that_fails_to_load_is_failed_at_once_with_the_reason(
        tiny_model: Path, tmp_path: Path) -> None:
    broken = copy_model(tiny_model, tmp_path / "bad-config")
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = "big"
    (broken / "config.json").write_text(json.dumps(config))
    with engine_daemon_running(tmp_path / "d", broken, backend="torch") as served:
        served.wait_state("failed", timeout=90)
        reply = engine(served.client(), "Generate", "sa{sv}", "hi", options(max_new_tokens=1))
        assert reply.error_name == ERROR + "EngineUnavailable"
        assert "loading" in reply.body[0] and "failed" in reply.body[0], reply.body
        assert "restarting" not in served.daemon.log()
        assert prop(served.bus, "ActiveProfile") == "sustained"


def test_a_worker_that_keeps_dying_while_loading_ends_failed_after_bounded_tries(
        tiny_model: Path, tmp_path: Path) -> None:
    """What the OOM killer does to a model too big for its cgroup: the worker dies during every
    load. After three deaths the engine is ``failed`` and says why; it does not loop."""
    with engine_daemon_running(tmp_path, tiny_model, backend="torch") as served:
        killed: list[int] = []
        deadline = time.monotonic() + 120
        while len(killed) < 3 and time.monotonic() < deadline:
            worker = worker_of(served)
            if worker.pid not in killed and served.engine_prop("State") == "loading":
                os.kill(worker.pid, signal.SIGKILL)
                killed.append(worker.pid)
            time.sleep(0.05)
        assert len(killed) == 3
        served.wait_state("failed", timeout=30)
        reply = engine(served.client(), "Generate", "sa{sv}", "hi", options(max_new_tokens=1))
        assert "died 3 times while loading" in reply.body[0], reply.body
        assert prop(served.bus, "ActiveProfile") == "sustained"
