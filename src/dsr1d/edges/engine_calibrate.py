"""Flash attention on or off, measured on this machine for this model and build, once.

Which is faster depends on the CPU, the model's shape and the depth of the context (on a
2-core VM the 1.5B decoded faster without it a few thousand tokens deep, where llama-server's
``auto`` turns it on; the figures are ``bench/depth.py``'s, in docs/engine.md). So with
``engine_flash_attn = auto`` the daemon starts llama-server both ways on the served file,
``ROUNDS`` times each, alternating, prefills ``DEPTH`` tokens and times ``TOKENS`` of decode,
and keeps the faster (on within ``TIE`` of off: on, llama-server's own choice). The result is
kept in the conversion cache under a key of the file, the binary, the threads and the CPU, so
later starts read it.
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


def choose(rates: dict[str, list[float]]) -> tuple[str, str]:
    """``on`` or ``off`` from decode rates measured both ways, and the reason in words."""
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    pick = "off" if off > on * (1 + TIE) else "on"
    return pick, f"decode {off:.1f} tok/s without flash attention, {on:.1f} with it"


def cache_key(spec: ServerSpec, binary: Path) -> str:
    """What the measurement depends on: the file, the binary, the threads, the CPU, how it
    is measured."""
    parts = [str(spec.gguf), str(_stat(spec.gguf)), str(binary), str(_stat(binary)),
             str(spec.threads), ",".join(map(str, spec.cpus)), cpu_model(),
             f"{DEPTH} {TOKENS} {ROUNDS}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


async def flash_attention(spec: ServerSpec, binary: Path, cache_dir: Path) -> tuple[str, str]:
    """The measured choice for ``spec`` and why (from the cache when measured before)."""
    key = cache_key(spec, binary)
    known = _read(cache_dir).get(key)
    if known:
        return known["flash_attn"], f"{known['why']} (measured {known['when']})"
    depth = max(64, min(DEPTH, spec.context - TOKENS - 16))
    log.info("engine: measuring flash attention on and off at %d tokens of context, once for "
             "this model, build and machine", depth)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(ROUNDS):
        for mode in ("off", "on"):
            rates[mode].append(await _decode_rate(spec, binary, mode, depth))
    pick, why = choose(rates)
    when = time.strftime("%Y-%m-%d")
    _write(cache_dir, key, {"flash_attn": pick, "why": why, "when": when,
                            "rates": rates, "depth": depth, "gguf": str(spec.gguf)})
    return pick, f"{why} (measured now)"


async def _decode_rate(spec: ServerSpec, binary: Path, mode: str, depth: int) -> float:
    with tempfile.TemporaryDirectory(prefix="dsr1d-calibrate-", dir=spec.socket.parent) as tmp:
        probe = dataclasses.replace(spec, socket=Path(tmp) / "probe.sock", parallel=1,
                                    context=depth + TOKENS + 16, draft=None, ngram=False,
                                    flash_attn=mode)
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
        log.warning("engine: cannot keep the flash attention measurement in %s: %s",
                    cache_dir, exc)


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return 0, 0

