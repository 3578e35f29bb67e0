"""org.dsr1d.Engine1 on the llama.cpp backend, end to end: the real daemon on a private bus
serving a GGUF file (the tiny synthetic model converted to Q8_0) — streaming, the same greedy
text as the in-process backend, cancel, a killed worker — and serving an HF directory with
``backend = auto``, converted once into the cache; a corrupt GGUF leaves the engine ``failed``
with the reason while the control plane keeps answering.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Iterator

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import ERROR, eventually, prop  # noqa: E402
from engine_fixtures import (ENGINE, ENGINE_SIGNALS, JOB_TIMEOUT, EngineDaemon,  # noqa: E402
                             engine, engine_async, engine_daemon_running, finished, first_token,
                             job_signals, options, plain, reply_of, worker_of)

pytest_plugins = ["engine_fixtures"]

from dbus_fast import MessageType  # noqa: E402

PROMPT = "Why is the sky blue?"


@pytest.fixture(scope="module")
def gguf_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsr1d.engine.gguf_convert import convert

    return convert(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", "int8")


@pytest.fixture(scope="module")
def reference(gguf_model: Path) -> dict[str, str]:
    from dsr1d.engine import llama_backend

    gen = llama_backend.load(gguf_model, threads=2)
    return {p: gen.generate(p, {"greedy": True, "ignore_eos": True, "max_new_tokens": 20}).text
            for p in (PROMPT, "hi")}


@pytest.fixture(scope="module")
def served(gguf_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineDaemon]:
    with engine_daemon_running(tmp_path_factory.mktemp("gguf-daemon"), gguf_model,
                               backend="llamacpp") as daemon:
        daemon.wait_state("ready")
        yield daemon


@pytest.fixture(scope="module")
def root(served: EngineDaemon):
    client = served.client()
    client.subscribe(ENGINE_SIGNALS)
    return client


def test_the_engine_serves_the_gguf_with_llama_cpp_and_logs_its_build(served) -> None:
    log = served.daemon.log()
    assert "on llamacpp" in log and "llama.cpp:" in log and "AVX" in log
    assert served.engine_prop("Model") == "tiny"
    assert served.engine_prop("Threads") == 2


def test_generate_gives_the_in_process_greedy_text(served, root, reference) -> None:
    for prompt, want in reference.items():
        reply = engine(root, "Generate", "sa{sv}", prompt,
                       options(greedy=True, ignore_eos=True, max_new_tokens=20))
        assert reply.error_name is None, reply.body
        text, stats = reply.body[0], plain(reply.body[1])
        assert text == want
        assert stats["backend"] == "llamacpp" and stats["new_tokens"] == 20
        assert stats["dtype"] == "int8"


def test_submit_streams_tokens_in_order_then_one_finished(served, root, reference) -> None:
    reply = engine(root, "Submit", "sa{sv}", PROMPT,
                   options(greedy=True, ignore_eos=True, max_new_tokens=20))
    job = reply.body[0]
    stats = finished(root, job)
    pieces = [m.body[1] for m in job_signals(root, job, "Token")]
    assert "".join(pieces) == reference[PROMPT]
    assert stats["finish_reason"] == "length"
    assert len(job_signals(root, job, "Finished")) == 1


def test_cancel_finishes_a_long_job_as_cancelled(served, root) -> None:
    job = engine(root, "Submit", "sa{sv}", PROMPT,
                 options(ignore_eos=True, max_new_tokens=900)).body[0]
    first_token(root, job)
    assert engine(root, "Cancel", "t", job).error_name is None
    stats = finished(root, job)
    assert stats["finish_reason"] == "cancelled" and stats["new_tokens"] < 900


def test_a_killed_worker_answers_the_caller_and_the_engine_comes_back(served, root) -> None:
    worker = worker_of(served)
    mark = len(root.signals)
    call = engine_async(root, "Generate", "sa{sv}", PROMPT,
                        options(ignore_eos=True, max_new_tokens=900))
    eventually(lambda: [m for m in root.signals[mark:] if m.member == "Token"],
               timeout=JOB_TIMEOUT, what="the first Token of this job")
    os.kill(worker.pid, signal.SIGKILL)
    reply = reply_of(call, "the Generate reply after the kill", timeout=15)
    assert reply.message_type == MessageType.ERROR
    assert reply.error_name == ERROR + "EngineUnavailable" and "died" in reply.body[0]
    assert prop(served.bus, "ActiveProfile") == "sustained"
    served.wait_state("ready")
    assert worker_of(served).pid != worker.pid
    again = engine(root, "Generate", "sa{sv}", "hi", options(greedy=True, max_new_tokens=5))
    assert again.error_name is None and plain(again.body[1])["new_tokens"] == 5


def test_an_hf_directory_under_auto_is_converted_once_into_the_cache(tiny_model: Path,
                                                                      tmp_path: Path) -> None:
    for run in range(2):
        with engine_daemon_running(tmp_path / f"run{run}", tiny_model, backend="auto") as served:
            served.wait_state("ready")
            log = served.daemon.log()
            reply = engine(served.client(), "Generate", "sa{sv}", "hi",
                           options(greedy=True, max_new_tokens=4))
            assert reply.error_name is None, reply.body
            assert plain(reply.body[1])["backend"] == "llamacpp"
            assert plain(reply.body[1])["dtype"] == "bf16"
            cache = tmp_path / "run0" / "cache"
            if run == 0:
                assert "converting" in log and "using the cached conversion" not in log
                # progress in sizes one can read: a 1 MB model is not "0.00 of 0.00 GB"
                assert re.search(r"converting to GGUF: 100 % \([\d.]+ MB of [\d.]+ MB", log), log
                entries = sorted(p.name for p in cache.glob("*.gguf"))
                assert len(entries) == 1
                # the second daemon shares this cache
                (tmp_path / "run1").mkdir()
                (tmp_path / "run1" / "cache").symlink_to(cache)
            else:
                assert "using the cached conversion" in log, log
                assert sorted(p.name for p in cache.glob("*.gguf")) == entries


def test_a_corrupt_gguf_leaves_the_engine_failed_with_the_reason(tmp_path: Path,
                                                                gguf_model: Path) -> None:
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(gguf_model.read_bytes()[: gguf_model.stat().st_size // 2])
    with engine_daemon_running(tmp_path / "d", broken, backend="auto") as served:
        served.wait_state("failed")
        assert prop(served.bus, "ActiveProfile") == "sustained"
        reply = engine(served.client(), "Generate", "sa{sv}", "hi", options(max_new_tokens=1))
        assert reply.error_name == ERROR + "EngineUnavailable"
        assert "truncated" in reply.body[0], reply.body
        assert served.engine_prop("State") == "failed"


# Subscribes as it is told (eavesdrop or not) to every Engine1 signal, prints READY, counts
# what arrives until stdin closes, then prints the count.
LISTENER = """\
import asyncio, sys
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    seen = []
    bus.add_message_handler(lambda m: seen.append(m) if m.message_type == MessageType.SIGNAL
                            and m.interface == "org.dsr1d.Engine1" else None)
    rules = ["type='signal',interface='org.dsr1d.Engine1'"]
    if sys.argv[2] == "eavesdrop":
        rules.append("type='signal',interface='org.dsr1d.Engine1',eavesdrop='true'")
    for rule in rules:
        reply = await bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="AddMatch", signature="s", body=[rule]))
        print("match", rule, reply.message_type.name, file=sys.stderr, flush=True)
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    print(len(seen), flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("nobody", [True, False], ids=["nobody-eavesdropping",
                                                       "another-root-connection"])
def test_another_client_receives_nothing_of_a_generation(served, root, nobody) -> None:
    """nobody tries both a plain and an eavesdropping match; another connection of root (which
    the system bus lets eavesdrop, as it could read the daemon's memory anyway) a plain one."""
    import subprocess
    import sys

    from daemon_fixtures import AS_NOBODY, read_line

    prefix = AS_NOBODY if nobody else ()
    listener = subprocess.Popen([*prefix, sys.executable, "-c", LISTENER, served.bus.address,
                                 "eavesdrop" if nobody else "plain"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(listener.stdout, what="the listener ready").strip() == "READY"
        reply = engine(root, "Generate", "sa{sv}", PROMPT,
                       options(greedy=True, ignore_eos=True, max_new_tokens=20))
        assert reply.error_name is None
        assert len(root.received("Token", ENGINE)) >= 20  # the caller got them
        listener.stdin.close()
        count = int(read_line(listener.stdout, what="the listener's count"))
    finally:
        listener.kill()
        listener.wait()
    assert count == 0


# Submits a long job, prints its id, then leaves the bus (exits) without waiting for it.
SUBMIT_AND_LEAVE = """\
import asyncio, sys
from dbus_fast import Message, Variant
from dbus_fast.aio import MessageBus

async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    reply = await bus.call(Message(
        destination="org.dsr1d", path="/org/dsr1d/engine", interface="org.dsr1d.Engine1",
        member="Submit", signature="sa{sv}",
        body=["hi", {"max_new_tokens": Variant("u", 3000), "ignore_eos": Variant("b", True)}]))
    print(reply.body[0], flush=True)
    bus.disconnect()

asyncio.run(main())
"""


def test_a_job_ends_when_its_caller_leaves_the_bus(served) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SUBMIT_AND_LEAVE, served.bus.address],
                          capture_output=True, text=True, timeout=30)
    job = int(proc.stdout)
    eventually(lambda: f"job {job}: its caller" in served.daemon.log(), timeout=JOB_TIMEOUT,
               what="the job cancelled when its caller left")
    served.wait_state("ready", timeout=JOB_TIMEOUT)
    assert prop(served.bus, "Holds") == []


def test_root_may_cancel_another_connections_job(served, root) -> None:
    other = served.client()
    job = engine(other, "Submit", "sa{sv}", PROMPT,
                 options(ignore_eos=True, max_new_tokens=3000)).body[0]
    eventually(lambda: served.engine_prop("State") == "busy", what="the job running")
    assert engine(root, "Cancel", "t", job).error_name is None
    served.wait_state("ready", timeout=JOB_TIMEOUT)
