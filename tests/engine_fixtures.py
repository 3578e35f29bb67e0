"""Fixtures for the inference-engine tests: the tiny synthetic R1-Distill-Qwen model (built once
per session), crafted variants of it, and the real daemon serving it on a private bus.

Test modules load this file as a plugin (``pytest_plugins = ["engine_fixtures"]``) so that its
fixtures and its report hook (the daemons' logs on a failing test) are active.

The tiny model is ``dsr1d.engine.synth.synthesize("tiny", …)``: the real Qwen2 architecture at
hidden size 64, two layers, a ~4000-token byte-level BPE tokenizer with R1's special tokens and
chat template; seconds to build and to load. Nothing here sleeps for a fixed time: every wait
polls with a deadline (``daemon_fixtures.eventually``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub read them
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from daemon_fixtures import (BUS_NAME, POLICY, BusClient, Daemon, busctl,  # noqa: E402
                             eventually)
import asyncio  # noqa: E402
from concurrent.futures import Future  # noqa: E402

import psutil  # noqa: E402
from dbus_fast import Message, Variant  # noqa: E402
from fakeroot import FakeRoot, intel_box  # noqa: E402
from harness.privbus import PrivateBus  # noqa: E402

ENGINE_PATH, ENGINE = "/org/dsr1d/engine", "org.dsr1d.Engine1"
TOOLS = ("dbus-daemon", "busctl", "dbus-send", "setpriv")
ENGINE_READY_TIMEOUT = 60.0   # a conversion, then llama-server's load
ENGINE_SIGNALS = f"type='signal',sender='{BUS_NAME}',path='{ENGINE_PATH}'"
JOB_TIMEOUT = 30.0

_RUNNING: list[Daemon] = []


# -- the models --------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (a real instruct model, Q4_1 GGUF), fetched once by set-up."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "tools" / "smollm2.sh"
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"tools/smollm2.sh failed: {proc.stderr[-2000:]}"
    return Path(proc.stdout.strip())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic DeepSeek-R1-Distill-Qwen directory (bf16 weights, seed 0)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dsr1d.engine import synth

    return Path(synth.synthesize("tiny", tmp_path_factory.mktemp("engine-model") / "tiny", seed=0))


def copy_model(src: Path, dst: Path) -> Path:
    """A private copy of a model directory that a test may break."""
    shutil.copytree(src, dst)
    return dst


def forced_token_model(src: Path, dst: Path, token: int) -> Path:
    """A copy of the tiny model whose greedy choice is ``token`` at every position.

    Only the checkpoint's data changes (the code under test is untouched): one residual dimension
    ``d`` is made a large constant of the embedding that neither attention nor the MLP writes to,
    the final RMSNorm keeps only ``d``, and only ``token``'s lm_head row reads it. The normed
    hidden state is then ``~sqrt(hidden) * e_d`` for every input, so ``token``'s logit is about 8
    and every other logit is 0.
    """
    from safetensors.torch import load_file, save_file

    copy_model(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    d = 1
    weights["model.embed_tokens.weight"][:, d] = 64.0
    for name, tensor in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor[d, :] = 0
    weights["model.norm.weight"].zero_()
    weights["model.norm.weight"][d] = 1.0
    head = weights["lm_head.weight"]
    head[:, d] = 0
    head[token, d] = 1.0
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def tiny_llama(out: Path, head_std: float | None = None, **config: Any) -> Path:
    """A tiny LlamaForCausalLM (the R1-Distill-Llama architecture) with the synthetic tokenizer,
    template and generation config; ``config`` overrides LlamaConfig keys, ``head_std``
    re-draws lm_head (init std 0.02 gives near-uniform logits)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsr1d.engine import synth

    synth.synthesize("tiny", out)
    for weights in out.glob("model*.safetensors*"):
        weights.unlink()
    ids = synth.special_ids()
    settings = dict(vocab_size=synth.tokenizer_size() + 32, hidden_size=64,
                    intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=2048,
                    bos_token_id=ids[synth.BOS], eos_token_id=ids[synth.EOS],
                    tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**settings, **config}))
    if head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std)
    model.save_pretrained(out)
    return out


# -- talking to the engine over the bus -----------------------------------------------------------

def options(**values: Any) -> dict[str, Variant]:
    """Generation options as D-Bus variants, typed as dsr1ctl sends them."""
    out = {}
    for key, value in values.items():
        sig = ("b" if isinstance(value, bool) else "u" if isinstance(value, int)
               else "d" if isinstance(value, float) else "s")
        out[key] = Variant(sig, value)
    return out


def engine(client: BusClient, member: str, signature: str = "", *body: Any) -> Message:
    return client.call(member, signature, *body, interface=ENGINE, path=ENGINE_PATH)


def engine_async(client: BusClient, member: str, signature: str, *body: Any) -> Future:
    """Start a call without waiting for its reply (a concurrent.futures.Future of it)."""
    msg = Message(destination=BUS_NAME, path=ENGINE_PATH, interface=ENGINE, member=member,
                  signature=signature, body=list(body))
    return asyncio.run_coroutine_threadsafe(client.bus.call(msg), client.loop)


def reply_of(future: Future, what: str, timeout: float = JOB_TIMEOUT) -> Message:
    eventually(future.done, timeout=timeout, what=what)
    return future.result()


def plain(stats: dict[str, Variant]) -> dict[str, Any]:
    return {k: v.value for k, v in stats.items()}


def job_signals(client: BusClient, job: int, member: str) -> list[Message]:
    return [m for m in client.received(member, ENGINE) if m.body[0] == job]


def finished(client: BusClient, job: int, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
    (msg,) = eventually(lambda: job_signals(client, job, "Finished"), timeout=timeout,
                        what=f"Finished for job {job}")
    return plain(msg.body[1])


def first_token(client: BusClient, job: int | None = None) -> Message:
    tokens = lambda: [m for m in client.received("Token", ENGINE)  # noqa: E731
                      if job is None or m.body[0] == job]
    return eventually(tokens, timeout=JOB_TIMEOUT, what="a Token signal")[0]


def worker_of(served: EngineDaemon) -> psutil.Process:
    """The daemon's engine process (llama-server)."""
    def find() -> psutil.Process | None:
        for child in psutil.Process(served.daemon.pid).children(recursive=True):
            try:
                if child.name() == "llama-server":
                    return child
            except psutil.NoSuchProcess:
                continue
        return None

    return eventually(find, timeout=10, what="the engine worker process")


# -- the daemon serving it -----------------------------------------------------------------------

@dataclass
class EngineDaemon:
    """A running ``dsr1d run`` with an engine, its private bus, fake root and a root client."""

    bus: PrivateBus
    daemon: Daemon
    fake: FakeRoot
    model: Path | None
    clients: list[BusClient] = field(default_factory=list)

    def client(self) -> BusClient:
        self.clients.append(BusClient(self.bus.address))
        return self.clients[-1]

    def engine_prop(self, name: str, nobody: bool = False) -> Any:
        proc = busctl(self.bus, "--json=short", "get-property", BUS_NAME, ENGINE_PATH, ENGINE,
                      name, nobody=nobody)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["data"]

    def wait_state(self, wanted: str, timeout: float = ENGINE_READY_TIMEOUT) -> str:
        def reached() -> bool:
            if not self.daemon.running():
                pytest.fail(f"dsr1d exited ({self.daemon.proc.returncode}):\n{self.daemon.log()}")
            return self.engine_prop("State") == wanted

        eventually(reached, timeout=timeout, interval=0.1, what=f"Engine1.State == {wanted!r}",
                   detail=lambda: f"--- dsr1d log ---\n{self.daemon.log()}")
        return wanted

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.daemon.cleanup()


def daemon_config(path: Path, model: Path | None, backend: str = "llamacpp",
                  extra: tuple[str, ...] | list[str] = ()) -> Path:
    """``sustained`` at start; with a model: llama-server, 2 threads, ``throughput`` while
    generating, conversions cached beside the config."""
    lines = ["[daemon]", "default_profile = sustained", "telemetry_interval_s = 1.0"]
    if model is not None:
        lines += [f"model = {model}", "engine_dtype = auto", "engine_threads = 2",
                  "engine_profile = throughput", f"engine_backend = {backend}",
                  f"engine_cache_dir = {path.parent / 'cache'}", *extra]
        for key, value in (("engine_flash_attn", "on"), ("engine_kv_type", "f16")):
            if not any(line.startswith(key) for line in extra):
                # measuring them costs six server starts; tests/test_engine_calibrate.py does
                lines.insert(lines.index(extra[0]) if extra else len(lines), f"{key} = {value}")
    path.write_text("\n".join(lines) + "\n")
    return path


def needs_bus() -> None:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in TOOLS):
        pytest.skip(f"needs root and {', '.join(TOOLS)}")


@contextmanager
def engine_daemon_running(workdir: Path, model: Path | None,
                          policies: tuple[Path, ...] = (POLICY,),
                          backend: str = "llamacpp",
                          extra_config: tuple[str, ...] | list[str] = ()) -> Iterator[EngineDaemon]:
    """A daemon on its own private bus, answering on entry (``ActiveProfile`` reads), stopped on
    exit; the engine may still be loading (``wait_state("ready")``). ``model=None``: no engine
    configured."""
    needs_bus()
    pytest.importorskip("dbus_fast")
    fake = intel_box(workdir / "root")
    config = daemon_config(workdir / "dsr1d.conf", model, backend, extra_config)
    with PrivateBus(policies) as bus:
        # No notify socket: the daemon sends STATUS= on every profile change, and a test socket
        # that nobody reads fills up (max_dgram_qlen) and then blocks the daemon in sd_notify.
        daemon = Daemon(bus, fake.path, config, workdir, notify=False)
        served = EngineDaemon(bus, daemon, fake, model)
        _RUNNING.append(daemon)
        try:
            daemon.start().wait_ready()
            yield served
        finally:
            served.close()
            _RUNNING.remove(daemon)


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[Path]:
    """A directory for the API's socket outside pytest's private tmp tree, so that another uid
    can reach the socket at all."""
    with tempfile.TemporaryDirectory(prefix="dsr1d-api-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


@contextmanager
def api_daemon_running(workdir: Path, model: Path, socket_dir: Path,
                       engine: tuple[str, ...] = (), api: tuple[str, ...] = ()
                       ) -> Iterator[EngineDaemon]:
    """``engine_daemon_running`` with ``engine`` lines in ``[engine]`` and ``api`` lines in
    ``[api]``, its socket ``socket_dir/api.sock``; entered once the engine is ready and the socket
    is there."""
    with engine_daemon_running(workdir, model,
                               extra_config=[*engine, "[api]", *api,
                                             f"socket = {socket_dir}/api.sock"]) as daemon:
        daemon.wait_state("ready")
        eventually((socket_dir / "api.sock").exists, timeout=10, what="the API socket")
        yield daemon


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Attach the logs of the engine daemons running now to a failing test's report."""
    report = yield
    if report.failed:
        for daemon in _RUNNING:
            report.sections.append((f"dsr1d log ({daemon.logfile.name})",
                                    daemon.log() or "(empty)"))
    return report
