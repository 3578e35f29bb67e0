"""Flash attention on or off, and the KV cache's type, measured on this machine for this model
and build, once.

Which is faster depends on the CPU, the model's shape and the depth of the context (on a 2-core
EPYC VM the 1.5B decoded faster without flash attention a few thousand tokens deep; on the 2-core
AMX VM, with dsr1d's grouped attention, fastest with it and a q8_0 cache, which also halves the
cache's bytes; the figures are ``bench/depth.py``'s, in docs/engine.md). So with
``engine_flash_attn = auto`` or ``engine_kv_type = auto`` the daemon starts llama-server each way
that is left open (`candidates`) on the served file, ``ROUNDS`` times each, alternating, prefills
``DEPTH`` tokens and times ``TOKENS`` of decode, and keeps the fastest; a setting earlier in the
list stays unless a later one is more than ``TIE`` faster (so llama-server's own choice, then an
exact F16 cache, wins a tie). The result is kept in the conversion cache under a key of the file,
the binary, the threads, the CPU and the settings measured, so later starts read it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from dsr1d.cpu import cpu_model
from dsr1d.edges import engine_command
from dsr1d.edges.engine_command import ServerSpec

log = logging.getLogger("dsr1d.engine")

# Tokens of context before the timed decode (capped by the context). The gap grows with depth
# (bench/depth.py, 1.5B int4, 2-core EPYC: decode off/on 0.95x at 0 tokens, 1.07x at 4,096,
# 1.25x at 16,384), so measure where R1's reasoning is, not at the start.
DEPTH = 4096
TOKENS = 32
ROUNDS = 2
TIE = 0.02              # "on" unless "off" is more than this much faster
FILE = "calibration.json"


Choice = tuple[str, str]        # (flash attention on/off, the KV cache's type)


def candidates(flash_attn: str, kv_type: str) -> list[Choice]:
    """The settings to measure for the configured ones (``auto`` leaves a setting open), in the
    order a tie keeps: flash attention on (llama-server's own choice) before off, then an F16
    cache (exact) before q8_0 (rounded)."""
    fa = ["on", "off"] if flash_attn == "auto" else [flash_attn]
    kv = ["f16", "q8_0"] if kv_type == "auto" else [kv_type]
    both = [(f, k) for k in kv for f in fa]
    if flash_attn == kv_type == "auto":
        # a q8_0 cache is K alone without flash attention (llama.cpp keeps V in F16 there), so it
        # saves half the bytes for the same conversions; set the two to measure it anyway
        both.remove(("off", "q8_0"))
    return both


def label(choice: Choice) -> str:
    """A setting in words: ``flash attention on, KV cache q8_0``."""
    return f"flash attention {choice[0]}, KV cache {choice[1]}"


def choose(rates: dict[Choice, list[float]]) -> tuple[Choice, str]:
    """The setting to keep from decode rates measured each way (in `candidates`' order), and
    the reason in words."""
    median = {choice: statistics.median(r) for choice, r in rates.items()}
    pick = next(iter(median))
    for choice, rate in median.items():
        if rate > median[pick] * (1 + TIE):
            pick = choice
    return pick, "decode " + ", ".join(f"{rate:.1f} tok/s with {label(choice)}"
                                       for choice, rate in median.items())


def cache_key(spec: ServerSpec, binary: Path, measured: list[Choice]) -> str:
    """What the measurement depends on: the file, the binary, the threads, the CPU, what is
    measured and how."""
    parts = [str(spec.gguf), str(_stat(spec.gguf)), str(binary), str(_stat(binary)),
             str(spec.threads), ",".join(map(str, spec.cpus)), cpu_model(),
             f"{DEPTH} {TOKENS} {ROUNDS}", " ".join(map(label, measured))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


async def attention(spec: ServerSpec, binary: Path, cache_dir: Path,
                    measured: list[Choice]) -> tuple[Choice, str]:
    """The fastest of ``measured`` for ``spec`` and why (from the cache when measured before)."""
    key = cache_key(spec, binary, measured)
    known = _read(cache_dir).get(key)
    if known:
        return (known["flash_attn"], known["kv_type"]), f"{known['why']} (measured {known['when']})"
    depth = max(64, min(DEPTH, spec.context - TOKENS - 16))
    log.info("engine: measuring decode at %d tokens of context with %s, %d rounds, once for this "
             "model, build and machine", depth, "; ".join(map(label, measured)), ROUNDS)
    rates: dict[Choice, list[float]] = {choice: [] for choice in measured}
    for _ in range(ROUNDS):
        for choice in measured:
            rates[choice].append(await _decode_rate(spec, binary, choice, depth))
    pick, why = choose(rates)
    when = time.strftime("%Y-%m-%d")
    _write(cache_dir, key, {"flash_attn": pick[0], "kv_type": pick[1], "why": why, "when": when,
                            "rates": {label(c): r for c, r in rates.items()}, "depth": depth,
                            "gguf": str(spec.gguf)})
    return pick, f"{why} (measured now)"


async def _decode_rate(spec: ServerSpec, binary: Path, choice: Choice, depth: int) -> float:
    with tempfile.TemporaryDirectory(prefix="dsr1d-calibrate-", dir=spec.socket.parent) as tmp:
        probe = dataclasses.replace(spec, socket=Path(tmp) / "probe.sock", parallel=1,
                                    context=depth + TOKENS + 16, draft=None, ngram=False,
                                    flash_attn=choice[0], kv_type=choice[1])
        proc = await asyncio.create_subprocess_exec(
            str(binary), *engine_command.arguments(probe), env=engine_command.environment(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=str(probe.socket))) as session:
                await _until_healthy(session, proc)
                # Token ids, not text: any vocabulary of more than 1,100 tokens takes them.
                body = {"prompt": [100 + (i * 7919) % 1000 for i in range(depth)],
                        "n_predict": TOKENS, "ignore_eos": True, "temperature": 0,
                        "cache_prompt": False}
                async with session.post("http://engine/completion", json=body) as resp:
                    timings: dict[str, Any] = (await resp.json())["timings"]
                    return float(timings["predicted_per_second"])
        finally:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()


async def _until_healthy(session: aiohttp.ClientSession,
                         proc: asyncio.subprocess.Process) -> None:
    while True:
        if proc.returncode is not None:
            raise OSError(f"llama-server exited with status {proc.returncode} while measuring")
        try:
            async with session.get("http://engine/health") as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.1)


def _read(cache_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((cache_dir / FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write(cache_dir: Path, key: str, entry: dict[str, Any]) -> None:
    known = _read(cache_dir)
    known[key] = entry
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".{FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache_dir / FILE)
    except OSError as exc:      # measured again next start; nothing else is lost
        log.warning("engine: cannot keep the attention measurement in %s: %s",
                    cache_dir, exc)


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return 0, 0

