"""org.dsr1d.Engine1 end to end: the real daemon (``dsr1d run``) on a private system-like bus
against a fake root, its engine (llama-server) serving a real instruct model, SmolLM2-135M-
Instruct (2 threads, ``engine_profile = throughput``), driven by busctl, dbus-send, dbus-fast and
dsr1ctl, as root and as nobody; and the tiny synthetic R1 model for R1's shape: its reasoning
split off by the server, a forced tool call through its template.

One daemon serves most of the module; the test that kills the engine runs last. Nothing sleeps
for a fixed time: every wait polls with a deadline.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import (BUS_NAME, DBUS_INVALID_ARGS, ERROR,  # noqa: E402
                             BusClient, busctl, dsr1ctl, error_of, eventually, prop, run)
from engine_fixtures import (ENGINE, ENGINE_PATH, ENGINE_SIGNALS, EngineDaemon, engine,
                             engine_daemon_running, finished, first_token, job_signals,
                             options, plain)

pytest_plugins = ["engine_fixtures"]

dbus_fast = pytest.importorskip("dbus_fast")
psutil = pytest.importorskip("psutil")
from dbus_fast import Variant  # noqa: E402

PROMPT = "What is the capital of France? Answer with one word."
LONG = 3000       # new tokens of a "long" job: seconds of decoding, within the 4096 context


def holds(served: EngineDaemon) -> list[list[Any]]:
    return prop(served.bus, "Holds")


@pytest.fixture(scope="module")
def served(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineDaemon]:
    """The daemon serving SmolLM2, 2 threads, ``engine_profile = throughput``, once
    ``Engine1.State`` is ``ready``."""
    with engine_daemon_running(tmp_path_factory.mktemp("engine-daemon"), smollm2,
                               extra_config=["engine_context = 4096"]) as daemon:
        daemon.wait_state("ready")
        yield daemon


@pytest.fixture(scope="module")
def root(served: EngineDaemon) -> BusClient:
    """A root dbus-fast connection subscribed to the engine's signals."""
    client = served.client()
    client.subscribe(ENGINE_SIGNALS)
    return client


@pytest.fixture(autouse=True)
def idle_engine(request):
    """Every test starts and ends with the engine idle and no hold left over."""
    if "served" not in request.fixturenames:
        yield
        return
    served = request.getfixturevalue("served")
    served.wait_state("ready")
    yield
    served.wait_state("ready")
    eventually(lambda: holds(served) == [], timeout=10, what="no holds")


def test_introspection_shows_the_engine_interface(served):
    proc = busctl(served.bus, "introspect", BUS_NAME, ENGINE_PATH, ENGINE)
    assert proc.returncode == 0, proc.stderr
    for member in ("Generate", "Submit", "Cancel", "Token", "Finished", "Model", "State",
                   "Threads", "TokensPerSecond"):
        assert member in proc.stdout, member


def test_generate_with_busctl_answers_in_the_text(served):
    proc = busctl(served.bus, "--json=short", "call", BUS_NAME, ENGINE_PATH, ENGINE, "Generate",
                  "sa{sv}", PROMPT, "2", "greedy", "b", "true", "max_new_tokens", "u", "16")
    assert proc.returncode == 0, proc.stderr
    text, stats = json.loads(proc.stdout)["data"]
    assert "Paris" in text
    assert stats["reasoning"]["data"] == "" and stats["answer_chars"]["data"] == len(text)
    assert stats["backend"]["data"] == "llama-server" and stats["threads"]["data"] == 2
    assert served.engine_prop("Model") == "SmolLM2-135M-Instruct.Q4_1"


def test_submit_streams_tokens_in_order_then_one_finished(served, root):
    whole = engine(root, "Generate", "sa{sv}", PROMPT, options(greedy=True, max_new_tokens=12))
    (job,) = root.ok("Submit", "sa{sv}", PROMPT, options(greedy=True, max_new_tokens=12),
                     interface=ENGINE, path=ENGINE_PATH)
    stats = finished(root, job)
    pieces = [m.body[1] for m in job_signals(root, job, "Token")]
    assert "".join(pieces) == whole.body[0]
    assert len(job_signals(root, job, "Finished")) == 1
    assert stats["new_tokens"] == plain(whole.body[1])["new_tokens"]


def test_cancel_finishes_a_long_job_as_cancelled(served, root):
    (job,) = root.ok("Submit", "sa{sv}", PROMPT, options(greedy=True, max_new_tokens=LONG,
                                                         ignore_eos=True),
                     interface=ENGINE, path=ENGINE_PATH)
    first_token(root, job)
    root.ok("Cancel", "t", job, interface=ENGINE, path=ENGINE_PATH)
    stats = finished(root, job)
    assert stats["finish_reason"] == "cancelled"


BAD_OPTIONS = [
    ({"bogus": Variant("b", True)}, "'bogus'"),
    ({"temperature": Variant("s", "hot")}, "'temperature'"),
    ({"max_new_tokens": Variant("b", True)}, "'max_new_tokens'"),
    ({"top_p": Variant("d", 0.0)}, "'top_p'"),
    ({"temperature": Variant("d", 3.0)}, "'temperature'"),
]


def test_bad_requests_are_invalid_argument(served, root):
    for opts, key in BAD_OPTIONS:
        for member in ("Generate", "Submit"):
            reply = engine(root, member, "sa{sv}", "hi", opts)
            assert reply.error_name == ERROR + "InvalidArgument", (member, opts, reply.body)
            assert key in reply.body[0] and "\n" not in reply.body[0]
    long_prompt = "hello there " * 3000
    reply = engine(root, "Generate", "sa{sv}", long_prompt, options(max_new_tokens=1))
    assert reply.error_name == ERROR + "InvalidArgument", reply.body
    assert "context" in reply.body[0], reply.body
    # the same refused by the engine for a Submit: its Finished says why
    (job,) = root.ok("Submit", "sa{sv}", long_prompt, options(max_new_tokens=1),
                     interface=ENGINE, path=ENGINE_PATH)
    assert "context" in finished(root, job)["error"]
    reply = engine(root, "Generate", "s", "hi")
    assert reply.error_name == DBUS_INVALID_ARGS
    reply = engine(root, "Cancel", "t", 987654)
    assert reply.error_name == ERROR + "InvalidArgument"
    # Nothing ran, and the engine still serves.
    assert engine(root, "Generate", "sa{sv}", "hi",
                  options(greedy=True, max_new_tokens=2)).error_name is None


def test_an_unprivileged_caller_is_denied_but_may_read(served):
    calls = [("Generate", ("sa{sv}", "hi", "1", "greedy", "b", "true")),
             ("Submit", ("sa{sv}", "hi", "0")), ("Cancel", ("t", "1"))]
    for member, busctl_args in calls:
        proc = busctl(served.bus, "call", BUS_NAME, ENGINE_PATH, ENGINE, member, *busctl_args,
                      nobody=True)
        assert proc.returncode != 0 and "needs root" in proc.stderr, (member, proc.stderr)
        assert "uid 65534" in proc.stderr, (member, proc.stderr)
    name, message = error_of(_send_engine(served, "Cancel", ("uint64:1",)))
    assert name == ERROR + "AccessDenied" and "uid 65534" in message, message
    for name in ("Model", "State", "Threads", "TokensPerSecond"):
        assert served.engine_prop(name, nobody=True) == served.engine_prop(name)
    proc = busctl(served.bus, "--json=short", "call", BUS_NAME, ENGINE_PATH,
                  "org.freedesktop.DBus.Properties", "GetAll", "s", ENGINE, nobody=True)
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)["data"][0]) == {"Model", "State", "Threads",
                                                       "TokensPerSecond"}


def _send_engine(served: EngineDaemon, member: str, args: tuple[str, ...]):
    """``dbus-send`` to the engine as nobody: its stderr names the D-Bus error."""
    return run(served.bus, "dbus-send", "--system", "--print-reply", f"--dest={BUS_NAME}",
               ENGINE_PATH, f"{ENGINE}.{member}", *args, nobody=True)


# -- the engine and the profiles -----------------------------------------------------------------

def test_the_engine_holds_its_profile_while_it_generates(served, root):
    assert prop(served.bus, "ActiveProfile") == "sustained" and holds(served) == []
    (job,) = root.ok("Submit", "sa{sv}", PROMPT, options(greedy=True, max_new_tokens=LONG,
                                                         ignore_eos=True),
                     interface=ENGINE, path=ENGINE_PATH)
    first_token(root, job)
    (hold,) = holds(served)
    assert hold[1] == "throughput" and hold[3] == "dsr1d-engine", hold
    assert prop(served.bus, "ActiveProfile") == "throughput"
    assert served.engine_prop("State") == "busy"
    root.ok("Cancel", "t", job, interface=ENGINE, path=ENGINE_PATH)
    finished(root, job)
    eventually(lambda: holds(served) == [], timeout=10, what="the engine's hold to go")
    assert prop(served.bus, "ActiveProfile") == "sustained"
    assert served.engine_prop("State") == "ready"


# -- dsr1ctl -------------------------------------------------------------------------------------

def test_dsr1ctl_generate_prints_the_answer_and_the_stats(served):
    proc = dsr1ctl(served.bus, "generate", PROMPT, "--greedy", "--max-new-tokens", "10")
    assert proc.returncode == 0, proc.stderr
    # Not a terminal: the answer is labelled; a model that does not think has no reasoning.
    assert proc.stdout.startswith("[answer]\n") and "Paris" in proc.stdout
    assert "[reasoning]" not in proc.stdout
    (stats_line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("-- ")]
    assert re.fullmatch(r"-- \d+ tokens \(\d+ prompt\), first token \d+ ms, "
                        r"[\d.]+ tokens/s decode, reasoning 0 chars, answer \d+ chars, "
                        r"Q4_1 on llama-server, 2 threads, stop: \w+", stats_line), stats_line


def test_another_client_receives_nothing_of_a_generation(served, root):
    other = served.client()
    other.subscribe(ENGINE_SIGNALS)
    (job,) = root.ok("Submit", "sa{sv}", PROMPT, options(greedy=True, max_new_tokens=8),
                     interface=ENGINE, path=ENGINE_PATH)
    finished(root, job)
    assert job_signals(root, job, "Token")
    assert not [m for m in other.signals if m.member in ("Token", "Finished")]


# -- no model configured -------------------------------------------------------------------------



def test_without_a_model_the_engine_is_unavailable(tmp_path):
    with engine_daemon_running(tmp_path, None) as bare:
        assert bare.engine_prop("State") == "unconfigured"
        assert (bare.engine_prop("Model"), bare.engine_prop("Threads")) == ("", 0)
        client = bare.client()
        for member, sig, body in (("Generate", "sa{sv}", ("hi", {})),
                                  ("Submit", "sa{sv}", ("hi", {})), ("Cancel", "t", (1,))):
            reply = engine(client, member, sig, *body)
            assert reply.error_name == ERROR + "EngineUnavailable", (member, reply.body)
            assert "no model configured" in reply.body[0]
        proc = dsr1ctl(bare.bus, "generate", "hi")
        assert proc.returncode == 5, (proc.returncode, proc.stderr)
        assert "no model configured" in proc.stderr
        # An unprivileged caller is refused by the daemon.
        name, message = error_of(_send_engine(bare, "Cancel", ("uint64:1",)))
        assert name == ERROR + "AccessDenied" and "uid 65534" in message, (name, message)
        proc = busctl(bare.bus, "call", BUS_NAME, ENGINE_PATH, ENGINE, "Generate", "sa{sv}",
                      "hi", "0", nobody=True)
        assert proc.returncode != 0 and "uid 65534" in proc.stderr, proc.stderr
        # The manager is unaffected.
        assert prop(bare.bus, "ActiveProfile") == "sustained"


# -- the R1 shape --------------------------------------------------------------------------------

def test_r1_reasoning_is_split_by_the_server(tiny_model, tmp_path):
    """The tiny synthetic R1-Distill-Qwen (random weights, R1's template): its output before
    ``</think>`` is reasoning, in Generate's stats, between dsr1ctl's markers, and in the API's
    ``reasoning_content``."""
    httpx = pytest.importorskip("httpx")
    sock_dir = Path(tempfile.mkdtemp(prefix="dsr1d-api-"))
    with engine_daemon_running(tmp_path, tiny_model,
                               extra_config=["[api]", f"socket = {sock_dir}/api.sock"]) as r1:
        r1.wait_state("ready", timeout=120)
        reply = engine(r1.client(), "Generate", "sa{sv}", "hi",
                       options(greedy=True, max_new_tokens=12, ignore_eos=True))
        assert reply.error_name is None, reply.body
        stats = plain(reply.body[1])
        assert stats["reasoning"] and stats["reasoning_chars"] == len(stats["reasoning"])
        proc = dsr1ctl(r1.bus, "generate", "hi", "--greedy", "--max-new-tokens", "8",
                       "--ignore-eos")
        assert proc.returncode == 0 and proc.stdout.startswith("[reasoning]\n"), proc.stdout
        http = httpx.Client(transport=httpx.HTTPTransport(uds=f"{sock_dir}/api.sock"),
                            timeout=120)
        answer = http.post("http://dsr1d/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}).json()["choices"][0]["message"]
        assert answer["reasoning_content"] and answer["content"] == ""   # no </think> yet
