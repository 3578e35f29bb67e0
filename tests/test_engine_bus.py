"""org.dsr1d.Engine1 end to end: the real daemon (``dsr1d run``) on a private system-like bus
against a fake root, its engine worker serving the tiny synthetic model (fp32, 2 threads,
``engine_profile = throughput``), driven by busctl, dbus-send, dbus-fast and dsr1ctl, as root and
as nobody.

One daemon serves the whole module (the worker's load takes seconds); the test that kills the
worker runs last. Nothing sleeps for a fixed time: every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Any, Iterator

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import (BUS_NAME, DBUS_INVALID_ARGS, ERROR,  # noqa: E402
                             BusClient, busctl, dsr1ctl, error_of, eventually, prop, run)
from engine_fixtures import (ENGINE, ENGINE_PATH, ENGINE_SIGNALS, JOB_TIMEOUT,  # noqa: E402
                             EngineDaemon, engine, engine_async, engine_daemon_running, finished,
                             first_token, job_signals, options, plain, reply_of, worker_of)

pytest_plugins = ["engine_fixtures"]

dbus_fast = pytest.importorskip("dbus_fast")
psutil = pytest.importorskip("psutil")
from dbus_fast import MessageType, Variant  # noqa: E402

PROMPT = "Why is the sky blue?"
LONG = 4000       # new tokens of a "long" job: seconds of decoding, within the 4096 context


def holds(served: EngineDaemon) -> list[list[Any]]:
    return prop(served.bus, "Holds")


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tiny_model,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineDaemon]:
    """The daemon serving the tiny model as fp32, 2 threads, ``engine_profile = throughput``,
    once ``Engine1.State`` is ``ready``. One for the module: the worker's load takes seconds,
    and the in-process reference is computed meanwhile."""
    with engine_daemon_running(tmp_path_factory.mktemp("engine-daemon"), tiny_model) as daemon:
        request.getfixturevalue("reference")
        daemon.wait_state("ready")
        yield daemon


@pytest.fixture(scope="module")
def root(served: EngineDaemon) -> BusClient:
    """A root dbus-fast connection subscribed to the engine's signals."""
    client = served.client()
    client.subscribe(ENGINE_SIGNALS)
    return client


@pytest.fixture(scope="module")
def reference(tiny_model):
    """In-process fp32 greedy outputs of the same model (the daemon path must match them)."""
    pytest.importorskip("torch")
    from dsr1d.engine.generate import Generator
    from dsr1d.engine.model import load

    generator = Generator(load(tiny_model, "fp32"))
    out = {}
    for prompt, n in ((PROMPT, 20), ("hi", 10)):
        pieces: list[str] = []
        result = generator.generate(prompt, {"greedy": True, "ignore_eos": True,
                                             "max_new_tokens": n}, pieces.append)
        out[prompt] = (result, pieces, len(generator.encode(prompt)))
    return out


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


# -- the interface -------------------------------------------------------------------------------

def test_introspection_shows_the_engine_interface(served):
    for nobody in (False, True):
        proc = busctl(served.bus, "introspect", BUS_NAME, ENGINE_PATH, ENGINE, nobody=nobody)
        assert proc.returncode == 0, proc.stderr
        rows = {line.split()[0]: line.split()[1:4] for line in proc.stdout.splitlines()[1:]
                if line.startswith(".")}
        assert rows[".Generate"] == ["method", "sa{sv}", "sa{sv}"]
        assert rows[".Submit"] == ["method", "sa{sv}", "t"]
        assert rows[".Cancel"] == ["method", "t", "-"]
        assert rows[".Token"] == ["signal", "ts", "-"]
        assert rows[".Finished"] == ["signal", "ta{sv}", "-"]
        assert rows[".Model"] == ["property", "s", '"tiny"']
        assert rows[".State"] == ["property", "s", '"ready"']
        assert rows[".Threads"] == ["property", "u", "2"]
        assert rows[".TokensPerSecond"][:2] == ["property", "d"]


def test_generate_with_busctl_equals_the_in_process_fp32_generator(served, reference):
    proc = busctl(served.bus, "--json=short", "call", BUS_NAME, ENGINE_PATH, ENGINE, "Generate",
                  "sa{sv}", PROMPT, "3", "greedy", "b", "true", "max_new_tokens", "u", "20",
                  "ignore_eos", "b", "true")
    assert proc.returncode == 0, proc.stderr
    text, stats = json.loads(proc.stdout)["data"]
    types = {k: v["type"] for k, v in stats.items()}
    stats = {k: v["data"] for k, v in stats.items()}
    expected, _, prompt_tokens = reference[PROMPT]
    assert text == expected.text  # the daemon path is the fp32 path, token for token
    assert stats["new_tokens"] == 20 and stats["prompt_tokens"] == prompt_tokens
    assert stats["finish_reason"] == "length"
    assert types["first_token_latency_s"] == types["decode_tokens_per_s"] == "d"
    assert stats["first_token_latency_s"] > 0 and stats["decode_tokens_per_s"] > 0
    assert "reasoning" not in stats and "answer" not in stats  # the text is not sent twice
    assert stats["reasoning_chars"] == len(expected.reasoning)
    assert stats["answer_chars"] == len(expected.answer)
    assert (stats["dtype"], stats["threads"]) == ("fp32", 2)
    assert served.engine_prop("TokensPerSecond") > 0


def test_submit_streams_tokens_in_order_then_one_finished(served, root, reference):
    from dsr1d.textstream import ThinkSplitter

    (job,) = root.ok("Submit", "sa{sv}", PROMPT, options(greedy=True, max_new_tokens=20,
                                                         ignore_eos=True),
                     interface=ENGINE, path=ENGINE_PATH)
    stats = finished(root, job)
    root.sync()
    pieces = [m.body[1] for m in job_signals(root, job, "Token")]
    expected, expected_pieces, _ = reference[PROMPT]
    # Raw text, in order: the same pieces the in-process generator streams.
    assert pieces == expected_pieces
    splitter = ThinkSplitter()
    splitter.feed("".join(pieces))
    splitter.finish()
    assert (stats["reasoning_chars"], stats["answer_chars"]) == (
        len(splitter.reasoning_text), len(splitter.answer_text))
    assert stats["new_tokens"] == 20 and stats["finish_reason"] == "length"
    # Exactly one Finished, after the job's last Token.
    order = [m for m in root.signals if m.interface == ENGINE and m.body[0] == job]
    assert [m.member for m in order] == ["Token"] * len(pieces) + ["Finished"]


def test_cancel_finishes_a_long_job_as_cancelled(served, root):
    (job,) = root.ok("Submit", "sa{sv}", PROMPT, options(greedy=True, max_new_tokens=LONG,
                                                         ignore_eos=True),
                     interface=ENGINE, path=ENGINE_PATH)
    first_token(root, job)
    root.ok("Cancel", "t", job, interface=ENGINE, path=ENGINE_PATH)
    stats = finished(root, job)
    assert stats["finish_reason"] == "cancelled"
    assert 1 <= stats["new_tokens"] < LONG
    # Cancelling a job that is over is a clear error.
    reply = engine(root, "Cancel", "t", job)
    assert reply.error_name == ERROR + "InvalidArgument", reply.body


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
    assert re.search(r"prompt is \d{4,} tokens", reply.body[0]) and "4096" in reply.body[0]
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

def test_dsr1ctl_generate_prints_the_text_and_the_stats(served, reference):
    proc = dsr1ctl(served.bus, "generate", "hi", "--greedy", "--max-new-tokens", "10",
                   "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    expected, pieces, prompt_tokens = reference["hi"]
    # Not a terminal: the reasoning is labelled, then printed as it streamed.
    assert proc.stdout == "[reasoning]\n" + "".join(pieces) + "\n"
    (stats_line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("-- ")]
    assert re.fullmatch(rf"-- 10 tokens \({prompt_tokens} prompt\), first token \d+ ms, "
                        r"[\d.]+ tokens/s decode, reasoning \d+ chars, answer 0 chars, "
                        r"fp32 on torch, 2 threads, stop: length", stats_line), stats_line


# -- a crash of the engine -----------------------------------------------------------------------

def test_engine_killed_mid_generation(served, root):
    """The caller gets EngineUnavailable (no hang), the daemon keeps answering, the engine comes
    back (restarting -> loading -> ready) and serves again. Last: it restarts the worker."""
    worker = worker_of(served)
    mark = len(root.signals)
    call = engine_async(root, "Generate", "sa{sv}", PROMPT,
                        options(greedy=True, max_new_tokens=LONG, ignore_eos=True))
    eventually(lambda: [m for m in root.signals[mark:] if m.member == "Token"], timeout=JOB_TIMEOUT,
               what="the first Token")
    assert holds(served), "the engine holds its profile while it generates"
    os.kill(worker.pid, signal.SIGKILL)

    reply = reply_of(call, "the Generate reply after the kill", timeout=15)
    assert reply.message_type == MessageType.ERROR
    assert reply.error_name == ERROR + "EngineUnavailable", reply.body
    assert "signal 9" in reply.body[0], reply.body

    # The control plane answers, and the engine's hold is gone with the job.
    assert prop(served.bus, "ActiveProfile") == "sustained"
    assert holds(served) == []
    # While it is down, a caller is told so at once.
    state = served.engine_prop("State")
    if state in ("restarting", "loading"):
        early = engine(root, "Generate", "sa{sv}", "hi", options(max_new_tokens=1))
        assert early.error_name == ERROR + "EngineUnavailable", early.body

    served.wait_state("ready")
    states = [m.body[1]["State"].value for m in root.signals[mark:]
              if m.member == "PropertiesChanged" and m.path == ENGINE_PATH
              and "State" in m.body[1]]
    after_kill = states[states.index("restarting"):]
    assert after_kill == ["restarting", "loading", "ready"], states
    assert worker_of(served).pid != worker.pid
    assert "died (signal 9)" in served.daemon.log()

    again = engine(root, "Generate", "sa{sv}", "hi", options(greedy=True, max_new_tokens=5))
    assert again.error_name is None, again.body
    assert plain(again.body[1])["new_tokens"] == 5


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


# -- text that D-Bus cannot carry ----------------------------------------------------------------

def test_a_nul_character_in_the_output_does_not_wedge_the_engine(tiny_model, tmp_path):
    from tokenizers import Tokenizer

    from engine_fixtures import forced_token_model

    (nul,) = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(
        "\x00", add_special_tokens=False).ids
    model = forced_token_model(tiny_model, tmp_path / "nul-model", nul)
    with engine_daemon_running(tmp_path / "daemon", model) as nul_served:
        nul_served.wait_state("ready")
        client = nul_served.client()
        call = engine_async(client, "Generate", "sa{sv}", "hi",
                            options(greedy=True, max_new_tokens=3))

        def answered_or_lost() -> str | None:
            if call.done():
                return "answered"
            log = nul_served.daemon.log()
            return "lost" if "on its channel" in log and "restarting" not in log else None

        outcome = eventually(answered_or_lost, timeout=JOB_TIMEOUT, what="the Generate reply")
        assert outcome == "answered", "the job's result was dropped: Generate will never answer"
        reply = call.result()
        assert reply.message_type == MessageType.METHOD_RETURN or \
            reply.error_name.startswith(ERROR), reply.error_name
        nul_served.wait_state("ready", timeout=10)
        assert holds(nul_served) == []
