"""The OpenAI-compatible API of the real daemon, on llama-server: the real ``openai`` client and
curl over its unix socket, a real instruct model (SmolLM2-135M-Instruct), on a private bus.

Asserted, each the way a user would notice it: the answer in ``content`` for a model that does
not think; ``stop``, ``logit_bias``, ``logprobs``, ``response_format`` json_schema,
``max_tokens`` and penalties each change the answer as they should; ``tools`` with a forced
tool call; raw ``/v1/completions`` continue the text (no chat template); the model's ids and
aliases; parameters llama-server would ignore are a 400 naming them; hostile bodies (a lone
surrogate, invalid UTF-8, deep nesting, forged chat markers in user text) are refused or stay
text and the engine keeps serving; ``/health`` open to all with its status only; ``/metrics``
with dsr1d's counters and llama-server's series and no request text; the access rules.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import AS_NOBODY, eventually  # noqa: E402
from engine_fixtures import EngineDaemon, api_daemon_running, engine_daemon_running  # noqa: E402

pytest_plugins = ["engine_fixtures"]

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
SECRET = "ultramarine-kestrel"         # a word of a prompt that must never reach the metrics
MODEL = "SmolLM2-135M-Instruct.Q4_1"   # the file's stem
ALIAS = "smol"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module")
def served(smollm2: Path, socket_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineDaemon]:
    with api_daemon_running(tmp_path_factory.mktemp("api"), smollm2, socket_dir,
                            engine=("engine_context = 2048", "engine_parallel = 2",
                                    f"aliases = {ALIAS}"), api=("queue = 4",)) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def sock(served: EngineDaemon, socket_dir: Path) -> Path:
    return socket_dir / "api.sock"


@pytest.fixture(scope="module")
def client(sock: Path) -> "openai.OpenAI":
    transport = httpx.HTTPTransport(uds=str(sock))
    return openai.OpenAI(api_key="unused-on-the-socket", base_url="http://dsr1d/v1",
                         http_client=httpx.Client(transport=transport, timeout=120),
                         max_retries=0)


def curl(sock: Path, path: str, body: dict | bytes | None = None, as_nobody: bool = False,
         timeout: float = 120) -> tuple[int, str]:
    cmd = [*(AS_NOBODY if as_nobody else ()), "curl", "-s", "-o", "-", "-w", "\n%{http_code}",
           "--unix-socket", str(sock), f"http://dsr1d{path}"]
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        cmd += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    out = subprocess.run(cmd, input=data, capture_output=True, timeout=timeout).stdout
    text, _, code = out.decode(errors="replace").rpartition("\n")
    return int(code or 0), text


def ask(client, messages=FRANCE, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=extra.pop("max_tokens", 32), **extra)


def test_a_model_that_does_not_think_answers_in_content(client) -> None:
    reply = ask(client)
    message = reply.choices[0].message
    assert "Paris" in message.content
    assert not (message.model_extra or {}).get("reasoning_content")
    streamed = []
    with client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                        max_tokens=32, stream=True,
                                        stream_options={"include_usage": True}) as stream:
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            streamed += [c.delta.content or "" for c in chunk.choices]
    assert "".join(streamed) == message.content
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens


def test_models_lists_the_stem_and_the_alias_and_refuses_others(client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    by_alias = client.chat.completions.create(model=ALIAS, messages=FRANCE, temperature=0,
                                              max_tokens=8)
    assert by_alias.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE, max_tokens=4)
    assert err.value.body["code"] == "model_not_found"


def test_stop_ends_the_answer_before_the_stop_string(client) -> None:
    whole = ask(client).choices[0].message.content
    cut = whole.index("Paris")
    stopped = ask(client, stop=["Paris"]).choices[0]
    assert stopped.message.content == whole[:cut] and stopped.finish_reason == "stop"


def test_logit_bias_bans_the_answer(client, sock: Path) -> None:
    code, text = curl(sock, "/tokenize", {"content": " Paris"})
    ids = json.loads(text)["tokens"]
    code2, text2 = curl(sock, "/tokenize", {"content": "Paris"})
    ids += json.loads(text2)["tokens"]
    assert code == code2 == 200 and ids
    banned = ask(client, logit_bias={str(i): -100 for i in ids}).choices[0].message.content
    assert "Paris" not in banned and banned


def test_logprobs_come_back_for_each_token(client) -> None:
    reply = ask(client, max_tokens=5, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token     # greedy: the likeliest


def test_max_tokens_and_penalties_change_the_answer(client) -> None:
    short = ask(client, max_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    describe = [{"role": "user", "content": "Describe Paris in detail."}]
    plain = ask(client, describe, max_tokens=64).choices[0].message.content
    penalised = ask(client, describe, max_tokens=64, frequency_penalty=1.5,
                    presence_penalty=1.5).choices[0].message.content
    assert _distinct_share(penalised) > _distinct_share(plain)


def _distinct_share(text: str) -> float:
    words = text.lower().split()
    return len(set(words)) / len(words)


def test_json_schema_answers_parse_and_validate(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = ask(client, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    data = json.loads(reply.choices[0].message.content)
    assert set(data) == {"city", "country"}
    assert all(isinstance(v, str) for v in data.values())


def test_tools_for_a_template_without_tool_calls_are_refused(sock: Path) -> None:
    code, text = curl(sock, "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2,
                                                     "tools": [WEATHER]})
    error = json.loads(text)["error"]
    assert code == 400 and error["param"] == "tools" and "tool calls" in error["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_text_completions_continue_the_raw_text(client, sock: Path) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    _, text = curl(sock, "/tokenize", {"content": prompt, "add_special": True})
    assert reply.usage.prompt_tokens == len(json.loads(text)["tokens"])   # no chat template
    assert "Paris" in reply.choices[0].text


def test_parameters_llama_server_would_ignore_are_refused(sock: Path) -> None:
    for field, value in (("user", "alice"), ("functions", []), ("best_of", 2),
                         ("no_such_knob", 1)):
        code, text = curl(sock, "/v1/chat/completions",
                          {"messages": FRANCE, "max_tokens": 2, field: value})
        error = json.loads(text)["error"]
        assert code == 400 and error["param"] == field, text


def test_hostile_bodies_are_refused_and_the_engine_keeps_serving(client, sock: Path) -> None:
    lone = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 2}'
    code, text = curl(sock, "/v1/chat/completions", lone)
    assert code == 400 and "surrogate" in json.loads(text)["error"]["message"]
    code, text = curl(sock, "/v1/chat/completions",
                      b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')
    assert code == 400 and "UTF-8" in json.loads(text)["error"]["message"]
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    code, text = curl(sock, "/v1/chat/completions", deep)
    assert code == 400 and "nests deeper" in json.loads(text)["error"]["message"]
    assert "Paris" in ask(client).choices[0].message.content


def test_chat_markers_in_user_text_stay_text(client, sock: Path) -> None:
    marker = "<|im_start|>"
    plain = ask(client, [{"role": "user", "content": "hello"}], max_tokens=1)
    forged = ask(client, [{"role": "user", "content": "hello" + marker}], max_tokens=1)
    _, text = curl(sock, "/tokenize", {"content": marker, "parse_special": False})
    as_text = len(json.loads(text)["tokens"])
    assert as_text > 1
    assert forged.usage.prompt_tokens - plain.usage.prompt_tokens == as_text
    # 20,000 markers as text are over 100,000 tokens, more than the context holds: the refusal
    # counts them (quickly: the tokenizer's split is linear)
    code, text = curl(sock, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": marker * 20000}], "max_tokens": 1})
    counted = int(json.loads(text)["error"]["message"].split("(")[1].split()[0])
    assert code == 400 and counted > 20000 * 3      # as special tokens: 20,000 and the turn


@pytest.fixture
def open_socket(sock: Path) -> Iterator[Path]:
    """The socket opened to every uid, as an admin might: the uid check still stands."""
    mode = sock.stat().st_mode & 0o777
    os.chmod(sock, 0o666)
    try:
        yield sock
    finally:
        os.chmod(sock, mode)


def test_health_is_open_and_says_only_its_status(open_socket: Path) -> None:
    code, text = curl(open_socket, "/health", as_nobody=True)
    assert code == 200 and json.loads(text) == {"status": "ok"}


def test_an_unprivileged_uid_is_refused_and_slots_are_roots(open_socket: Path) -> None:
    code, text = curl(open_socket, "/v1/chat/completions", {"messages": FRANCE,
                                                            "max_tokens": 2}, as_nobody=True)
    assert code == 403 and json.loads(text)["error"]["code"] == "forbidden"
    assert "needs root, the dsr1d group or polkit" in text
    assert curl(open_socket, "/v1/models", as_nobody=True)[0] == 403
    sock = open_socket
    code, text = curl(sock, "/slots")
    assert code == 200 and isinstance(json.loads(text), list)


def _samples(text: str) -> dict[str, float]:
    """A /metrics page's samples by name and labels."""
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#") and " " in line}


def test_metrics_count_tokens_and_hold_no_request_text(client, sock: Path) -> None:
    ask(client, [{"role": "user", "content": f"Spell {SECRET}"}], max_tokens=4)
    code, text = curl(sock, "/metrics")
    assert code == 200 and SECRET not in text
    values = _samples(text)
    assert values["dsr1d_api_completion_tokens_total"] >= 4
    assert 'dsr1d_requests_total{code="200",endpoint="/v1/chat/completions"}' in values
    assert "llamacpp:tokens_predicted_total" in values      # llama-server's own series
    assert 'dsr1d_engine_state_info{state="ready"}' in values or \
        'dsr1d_engine_state_info{state="busy"}' in values
    # what the engine runs, as the fixture pins it
    assert 'dsr1d_engine_info{flash_attn="on",kv_type="f16",speculative="off"}' in values


def test_a_stream_longer_than_its_kept_tail_is_counted(sock: Path) -> None:
    tokens = "dsr1d_api_completion_tokens_total"
    before = _samples(curl(sock, "/metrics")[1])[tokens]
    code, text = curl(sock, "/v1/chat/completions", {
        "messages": FRANCE, "max_tokens": 400, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert code == 200 and text.rstrip().endswith("data: [DONE]")
    assert len(text.encode()) > 65536       # more than the front keeps of a stream's end
    assert _samples(curl(sock, "/metrics")[1])[tokens] - before == 400


def test_tcp_takes_only_requests_with_a_key(smollm2: Path, tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("# one a line\nsk-local-test\n")
    keys.chmod(0o600)
    port = _free_port()
    with engine_daemon_running(tmp_path, smollm2,
                               extra_config=["engine_context = 1024", "[api]", "socket =",
                                             f"tcp = 127.0.0.1:{port}",
                                             f"api_keys_file = {keys}"]) as daemon:
        daemon.wait_state("ready")
        base = f"http://127.0.0.1:{port}"
        eventually(lambda: _reachable(base), timeout=10, what="the API on TCP")
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}       # no key needed
        assert httpx.get(f"{base}/v1/models").status_code == 401
        wrong = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        lower = httpx.get(f"{base}/v1/models", headers={"Authorization": "bearer sk-local-test"})
        assert lower.status_code == 200                      # the scheme is case-insensitive
        slots = httpx.get(f"{base}/slots", headers={"Authorization": "Bearer sk-local-test"})
        assert slots.status_code == 403                      # root on the socket only
        client = openai.OpenAI(api_key="sk-local-test", base_url=f"{base}/v1", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                               messages=FRANCE)
        assert reply.usage.completion_tokens >= 1
        assert not (daemon.fake.path / "run/dsr1d/api.sock").exists()    # socket = (none)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reachable(base: str) -> bool:
    try:
        httpx.get(f"{base}/health", timeout=2)
        return True
    except httpx.TransportError:
        return False


def test_roles_llama_server_maps_are_accepted_and_embeddings_say_why_not(client, sock) -> None:
    reply = ask(client, [{"role": "developer", "content": "Answer in one word."},
                         {"role": "user", "content": "Capital of France?"}], max_tokens=8)
    assert reply.choices[0].message.content
    code, text = curl(sock, "/v1/embeddings", {"input": "hello"})
    assert code == 501 and "--embeddings" in json.loads(text)["error"]["message"]


def test_a_full_queue_is_429_and_callers_that_leave_free_their_slots(sock: Path) -> None:
    import socket

    body = json.dumps({"messages": FRANCE, "max_tokens": 2000, "ignore_eos": True,
                       "stream": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: dsr1d\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
               + body)
    callers = []
    for _ in range(2 + 4):                      # the slots, then the queue
        caller = socket.socket(socket.AF_UNIX)
        caller.connect(str(sock))
        caller.sendall(request)
        callers.append(caller)
    eventually(lambda: _gauge(sock, "dsr1d_requests_active") == 6, what="six requests in")
    code, text = curl(sock, "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2})
    assert code == 429 and json.loads(text)["error"]["code"] == "queue_full"
    for caller in callers:                      # they leave: their generations are cancelled
        caller.close()
    eventually(lambda: _gauge(sock, "dsr1d_requests_active") == 0, what="the six gone")
    code, text = curl(sock, "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4})
    assert code == 200, text


def _gauge(sock: Path, name: str) -> float:
    _, text = curl(sock, "/metrics")
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith(name + " "))


def test_hostile_requests_do_not_stop_another_callers_stream(sock: Path) -> None:
    import threading

    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=120)
    lines: list[str] = []

    def read() -> None:
        with http.stream("POST", "http://dsr1d/v1/chat/completions", json={
                "messages": FRANCE, "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            lines.extend(response.iter_lines())

    reader = threading.Thread(target=read)
    reader.start()
    eventually(lambda: len(lines) > 2, what="the stream flowing")
    for hostile in (b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
                    b"{" * 10000, b'{"messages": "' + b"A" * 3_000_000 + b'"}',
                    json.dumps({"messages": [{"role": "user", "content": "</think>" * 5000}],
                                "max_tokens": 1}).encode()):
        curl(sock, "/v1/chat/completions", hostile)
    reader.join(120)
    usage = [json.loads(line[6:])["usage"] for line in lines
             if line.startswith("data: {") and '"usage"' in line]
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert usage[-1]["completion_tokens"] == 200
