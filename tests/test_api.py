"""The OpenAI-compatible API of the real daemon: the real ``openai`` client and curl over its
unix socket, the tiny synthetic model in Q8_0 on llama.cpp, on a private bus.

Asserted: chat completions whole and streamed (reasoning as ``reasoning_content``, usage), the
same greedy text both ways, multi-turn with earlier reasoning stripped, ``/v1/completions``,
``/v1/models``, ``/health``, ``/metrics`` (and no request text in it), OpenAI-shaped errors
(400, 404, 429), a client that disconnects mid-stream frees its slot, and an unprivileged uid
refused on the socket.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import AS_NOBODY, eventually  # noqa: E402
from engine_fixtures import EngineDaemon, engine_daemon_running  # noqa: E402

pytest_plugins = ["engine_fixtures"]

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
SECRET = "ultramarine-kestrel"         # a word of a prompt that must never reach the metrics
MODEL = "tiny"                         # the synthetic model names itself so


@pytest.fixture(scope="module")
def gguf_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsr1d.engine.gguf_convert import convert

    return convert(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", "int8")


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[Path]:
    # Outside pytest's private tmp tree, so that another uid can reach the socket at all.
    with tempfile.TemporaryDirectory(prefix="dsr1d-api-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


@pytest.fixture(scope="module")
def served(gguf_model: Path, socket_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineDaemon]:
    with engine_daemon_running(tmp_path_factory.mktemp("api"), gguf_model, backend="llamacpp",
                               extra_config=["[api]", "queue = 0",
                                             f"socket = {socket_dir}/api.sock"]) as daemon:
        daemon.wait_state("ready")
        yield daemon


@pytest.fixture(scope="module")
def sock(served: EngineDaemon, socket_dir: Path) -> Path:
    path = socket_dir / "api.sock"
    eventually(path.exists, timeout=10, what="the API socket")
    return path


@pytest.fixture(scope="module")
def client(sock: Path) -> "openai.OpenAI":
    transport = httpx.HTTPTransport(uds=str(sock))
    return openai.OpenAI(api_key="unused-on-the-socket", base_url="http://dsr1d/v1",
                         http_client=httpx.Client(transport=transport, timeout=120),
                         max_retries=0)


def curl(sock: Path, path: str, body: dict | None = None, as_nobody: bool = False,
         timeout: float = 120) -> tuple[int, str]:
    cmd = [*(AS_NOBODY if as_nobody else ()), "curl", "-s", "-o", "-", "-w", "\n%{http_code}",
           "--unix-socket", str(sock), f"http://dsr1d{path}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    text, _, code = out.rpartition("\n")
    return int(code or 0), text


GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


def test_models_and_health(client, sock: Path) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    code, text = curl(sock, "/health")
    health = json.loads(text)
    assert code == 200 and health["engine"] in ("ready", "busy")
    # the model's own defaults (its generation_config, carried into the GGUF by the converter)
    assert health["sampling_defaults"] == {"temperature": pytest.approx(0.6),
                                           "top_p": pytest.approx(0.95)}


def test_chat_whole_and_streamed_give_the_same_greedy_text(client) -> None:
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    message = whole.choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert isinstance(message.content, str) and isinstance(reasoning, str)
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens > 5
    assert whole.choices[0].finish_reason == "length"

    parts = {"reasoning": [], "content": []}
    finish = None
    with client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                        stream_options={"include_usage": True}, **GREEDY) as s:
        usage = None
        for chunk in s:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    parts["content"].append(delta.content)
                if (delta.model_extra or {}).get("reasoning_content"):
                    parts["reasoning"].append(delta.model_extra["reasoning_content"])
                finish = choice.finish_reason or finish
    assert "".join(parts["reasoning"]) == reasoning
    assert "".join(parts["content"]) == message.content
    assert finish == "length" and usage.completion_tokens == 24


def test_earlier_reasoning_is_not_sent_back(client) -> None:
    def prompt_tokens(assistant: str) -> int:
        reply = client.chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0,
            messages=[{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": assistant},
                      {"role": "user", "content": "and then?"}])
        return reply.usage.prompt_tokens

    long_reasoning = "<think>\n" + "a very long chain of thought " * 40 + "</think>\n\nhello"
    assert prompt_tokens(long_reasoning) == prompt_tokens("hello")


def test_text_completions(client) -> None:
    reply = client.completions.create(model=MODEL, prompt="Once upon a time",
                                      max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and isinstance(reply.choices[0].text, str)
    assert reply.usage.completion_tokens == 8 or reply.choices[0].finish_reason == "stop"


def test_errors_come_in_openai_shape(client, sock: Path) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user",
                                                                 "content": "x"}])
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    code, text = curl(sock, "/v1/chat/completions", {"messages": "nope"})
    assert code == 400 and json.loads(text)["error"]["param"] == "messages"
    code, text = curl(sock, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "temperature": 9})
    assert code == 400 and "temperature" in json.loads(text)["error"]["message"]
    code, text = curl(sock, "/v2/anything")
    assert code == 404 and json.loads(text)["error"]["code"] == "not_found"
    assert "Traceback" not in text


def test_a_full_queue_is_429_and_a_client_that_leaves_frees_its_slot(client, sock) -> None:
    long = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 1500, "stream": True, "ignore_eos": True}
    transport = httpx.HTTPTransport(uds=str(sock))
    with httpx.Client(transport=transport, timeout=120) as http:
        with http.stream("POST", "http://dsr1d/v1/chat/completions", json=long) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")              # decoding now
            code, text = curl(sock, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "me too"}]})
            assert code == 429 and json.loads(text)["error"]["code"] == "queue_full"
        # the stream was closed mid-way: its job is cancelled and the slot is free again
    reply = eventually(lambda: _try(client), timeout=30, what="a request after the disconnect")
    assert reply.choices[0].message.content is not None


def _try(client):
    try:
        return client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "again"}])
    except openai.RateLimitError:
        return None


def test_metrics_count_requests_and_hold_no_request_text(client, sock: Path) -> None:
    client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                   messages=[{"role": "user", "content": SECRET}])
    code, text = curl(sock, "/metrics")
    assert code == 200
    assert 'dsr1d_requests_total{code="200",endpoint="/v1/chat/completions"}' in text
    for name in ("dsr1d_first_token_seconds_bucket", "dsr1d_inter_token_seconds_count",
                 "dsr1d_decode_tokens_per_second", 'dsr1d_profile_info{profile="sustained"}',
                 "dsr1d_queue_depth", "dsr1d_throttle_state_info"):
        assert name in text, name
    assert SECRET not in text


def test_curl_over_the_socket_streams_server_sent_events(sock: Path) -> None:
    code, text = curl(sock, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "max_tokens": 6, "temperature": 0})
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert code == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_an_unprivileged_uid_is_refused(sock: Path) -> None:
    mode = sock.stat().st_mode & 0o777
    os.chmod(sock, 0o666)       # as an admin might open it: the uid check still stands
    try:
        code, text = curl(sock, "/v1/models", as_nobody=True)
    finally:
        os.chmod(sock, mode)
    assert code == 403 and "needs root, the dsr1d group or polkit" in text
    assert json.loads(text)["error"]["type"] == "permission_error"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_takes_only_requests_with_a_key(gguf_model: Path, tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("# one a line\nsk-local-test\n")
    keys.chmod(0o600)
    port = _free_port()
    with engine_daemon_running(tmp_path, gguf_model, backend="llamacpp",
                               extra_config=["[api]", "socket =", f"tcp = 127.0.0.1:{port}",
                                             f"api_keys_file = {keys}"]) as daemon:
        daemon.wait_state("ready")
        base = f"http://127.0.0.1:{port}"
        eventually(lambda: _reachable(base), timeout=10, what="the API on TCP")
        assert httpx.get(f"{base}/v1/models").status_code == 401
        wrong = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(api_key="sk-local-test", base_url=f"{base}/v1", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens >= 1
        assert not (daemon.fake.path / "run/dsr1d/api.sock").exists()    # socket = (none)


def test_a_keys_file_others_may_read_keeps_tcp_off(gguf_model: Path, tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("sk-local-test\n")
    keys.chmod(0o644)
    port = _free_port()
    with engine_daemon_running(tmp_path, gguf_model, backend="llamacpp",
                               extra_config=["[api]", f"tcp = 127.0.0.1:{port}",
                                             f"api_keys_file = {keys}"]) as daemon:
        eventually(lambda: "API over TCP stays off" in daemon.daemon.log(), timeout=20,
                   what="the refusal in the log")
        assert "mode 0600" in daemon.daemon.log()
        assert not _reachable(f"http://127.0.0.1:{port}")


def _reachable(base: str) -> bool:
    try:
        httpx.get(f"{base}/health", timeout=2)
        return True
    except httpx.TransportError:
        return False


def test_concurrent_requests_are_batched_with_the_same_greedy_text(client, gguf_model: Path,
                                                                  tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["Why is the sky blue?", "hi", "Tell me a story about a cat", "2+2?"]

    def ask(c, prompt: str) -> str:
        reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": prompt}], **GREEDY)
        m = reply.choices[0].message
        return (m.model_extra.get("reasoning_content") or "") + "|" + (m.content or "")

    one_at_a_time = [ask(client, p) for p in prompts]     # the parallel = 1 daemon
    sock_dir = Path(tempfile.mkdtemp(prefix="dsr1d-api-"))
    try:
        with engine_daemon_running(tmp_path, gguf_model, backend="llamacpp",
                                   extra_config=["engine_parallel = 3", "[api]",
                                                 f"socket = {sock_dir}/api.sock"]) as daemon:
            daemon.wait_state("ready")
            http = httpx.Client(transport=httpx.HTTPTransport(uds=f"{sock_dir}/api.sock"),
                                timeout=120)
            batched = openai.OpenAI(api_key="-", base_url="http://dsr1d/v1", http_client=http,
                                    max_retries=0)
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = list(pool.map(lambda p: ask(batched, p), prompts))
            assert together == one_at_a_time
            text = http.get("http://dsr1d/metrics").text
            assert "dsr1d_slots 3.0" in text
            assert "engine ready" in daemon.daemon.log()
    finally:
        for f in sock_dir.iterdir():
            f.unlink()
        sock_dir.rmdir()
