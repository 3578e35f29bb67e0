"""Supervision of llama-server that never gives up, on the real daemon and a private bus: a
result larger than any line limit arrives whole, a hung server is killed and replaced with its
caller answered and the engine's hold released, a server killed mid-stream answers its API
callers and comes back without a daemon restart, and a model that cannot load is retried with
growing back-off, the reason kept, never "failed" for good — and ``Reload`` retries at once.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import ERROR, busctl, eventually, prop  # noqa: E402
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
    with engine_daemon_running(tmp_path, long_output_gguf,
                               extra_config=["engine_context = 8192"]) as served:
        served.wait_state("ready")
        call = engine_async(served.client(), "Generate", "sa{sv}", "hi",
                            options(greedy=True, ignore_eos=True, max_new_tokens=5000))
        reply = reply_of(call, "the Generate reply", timeout=120)
        assert reply.message_type == MessageType.METHOD_RETURN, reply.body
        text, stats = reply.body[0], {k: v.value for k, v in reply.body[1].items()}
        # an R1 template opens a think block: everything before </think> is reasoning
        assert text == "" and stats["reasoning"].strip() == (LONG_PIECE * 5000).strip()
        assert stats["new_tokens"] == 5000 and stats["reasoning_chars"] > 65536
        assert served.engine_prop("State") == "ready"
        assert "killing it" not in served.daemon.log()


def test_a_hung_server_is_killed_its_caller_answered_and_the_engine_replaced(
        long_output_gguf: Path, tmp_path: Path) -> None:
    with engine_daemon_running(tmp_path, long_output_gguf,
                               extra_config=["engine_ping_timeout_s = 3",
                                             "engine_context = 8192"]) as served:
        served.wait_state("ready")
        client = served.client()
        call = engine_async(client, "Generate", "sa{sv}", "hi",
                            options(greedy=True, ignore_eos=True, max_new_tokens=8000))
        server = worker_of(served)
        eventually(lambda: served.engine_prop("State") == "busy", what="the job running")
        assert prop(served.bus, "Holds"), "the engine holds its profile while it generates"
        os.kill(server.pid, signal.SIGSTOP)
        reply = reply_of(call, "the Generate reply after the hang", timeout=30)
        assert reply.error_name == ERROR + "EngineUnavailable", reply.body
        assert "answered no health check" in served.daemon.log()
        eventually(lambda: prop(served.bus, "Holds") == [], what="the engine's hold released")
        served.wait_state("ready", timeout=30)
        assert worker_of(served).pid != server.pid
        again = engine(client, "Generate", "sa{sv}", "hi", options(greedy=True, max_new_tokens=3))
        assert again.error_name is None, again.body


def test_a_server_killed_mid_stream_answers_api_callers_and_comes_back(
        smollm2: Path, tmp_path: Path) -> None:
    httpx = pytest.importorskip("httpx")
    sock_dir = Path(tempfile.mkdtemp(prefix="dsr1d-api-"))
    with engine_daemon_running(tmp_path, smollm2,
                               extra_config=["engine_context = 4096", "[api]",
                                             f"socket = {sock_dir}/api.sock"]) as served:
        served.wait_state("ready")
        http = httpx.Client(transport=httpx.HTTPTransport(uds=f"{sock_dir}/api.sock"),
                            timeout=60)
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 3000, "ignore_eos": True, "stream": True}
        ended = threading.Event()
        seen: list[str] = []

        def read() -> None:
            try:
                with http.stream("POST", "http://dsr1d/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        seen.append(line)
            except httpx.HTTPError as exc:
                seen.append(f"transport: {exc}")
            ended.set()

        threading.Thread(target=read, daemon=True).start()
        eventually(lambda: len(seen) > 3, what="the stream flowing")
        server = worker_of(served)
        server.kill()
        assert ended.wait(30), "the caller was left hanging"
        assert not any("[DONE]" in line for line in seen)       # it did not end as if complete
        served.wait_state("ready", timeout=60)
        assert worker_of(served).pid != server.pid
        reply = http.post("http://dsr1d/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200, reply.text


def test_a_model_that_fails_to_load_is_retried_with_the_reason_and_reload_retries_now(
        tiny_model: Path, tmp_path: Path) -> None:
    broken = copy_model(tiny_model, tmp_path / "bad-config")
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = "big"
    (broken / "config.json").write_text(json.dumps(config))
    with engine_daemon_running(tmp_path / "d", broken) as served:
        served.wait_state("restarting", timeout=90)
        reply = engine(served.client(), "Generate", "sa{sv}", "hi", options(max_new_tokens=1))
        assert reply.error_name == ERROR + "EngineUnavailable"
        assert "restarting" in reply.body[0] and "hidden_size" in reply.body[0], reply.body
        assert prop(served.bus, "ActiveProfile") == "sustained"
        eventually(lambda: served.daemon.log().count("engine cannot start") >= 2, timeout=30,
                   what="a second try after the back-off")
        tries = served.daemon.log().count("engine cannot start")
        # the model is fixed; Reload tries again at once instead of waiting out the back-off
        config["hidden_size"] = json.loads((tiny_model / "config.json").read_text())[
            "hidden_size"]
        (broken / "config.json").write_text(json.dumps(config))
        proc = busctl(served.bus, "call", "org.dsr1d", "/org/dsr1d", "org.dsr1d.Manager1",
                      "Reload")
        assert proc.returncode == 0, proc.stderr
        served.wait_state("ready", timeout=60)
        assert served.daemon.log().count("engine cannot start") == tries
