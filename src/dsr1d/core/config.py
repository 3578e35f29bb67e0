"""The daemon's configuration file, ``/etc/dsr1d/dsr1d.conf``.

Same INI dialect as profiles, so errors come as ``file:line: reason``. A missing file means the
defaults; a broken one stops the daemon before it touches anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from dsr1d.constants import ENGINE_BACKENDS, ENGINE_DTYPES, NGRAM
from dsr1d.contract.schema import Schema, boolean, choice, integer, option, word_list
from dsr1d.contract.sysroot import parse_cpu_list
from dsr1d.core.profiles import ProfileError, parse_ini, section_line, validate_section

DEFAULT_PATH = Path("/etc/dsr1d/dsr1d.conf")


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not a number") from None
    if not 0.05 <= value <= 3600:
        raise ValueError(f"{value} is outside 0.05..3600")
    return value


def _absolute(raw: str) -> str:
    if not raw.startswith("/"):
        raise ValueError(f"{raw!r} is not an absolute path")
    return raw


def parse_cpu_list_option(raw: str) -> list[int]:
    try:
        cpus = parse_cpu_list(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not a CPU list like 0-3,8") from None
    if not cpus:
        raise ValueError("empty CPU list")
    return cpus


def _single(raw: str) -> str:
    words = word_list(raw)
    if len(words) != 1:
        raise ValueError(f"expected one profile name, got {raw!r}")
    return words[0]


def _draft(raw: str) -> str:
    return raw if raw in ("", NGRAM) else _absolute(raw)


DAEMON_SCHEMA: Schema = {
    "default_profile": option(_single, "profile applied at start", "name"),
    "telemetry_interval_s": option(_positive_float, "seconds between telemetry samples", "s"),
    "root": option(_absolute, "hardware root (/ on a real machine)", "path"),
    "journal": option(_absolute, "journal path (default <root>/run/dsr1d/state.json)", "path"),
    "profiles_dir": option(_absolute, "user profiles (default <root>/etc/dsr1d/profiles)", "path"),
    "model": option(_absolute, "the model the engine serves: a .gguf file or a local Hugging "
                    "Face directory (unset: no engine)", "path"),
    "engine_backend": option(choice(*ENGINE_BACKENDS), "auto or llamacpp: llama-server built "
                             "from dsr1d's llama.cpp (torch is the numerical reference only)",
                             "name"),
    "engine_server": option(_absolute, "the llama-server binary (default: the one set-up "
                            "built, next to dsr1d's Python, or /usr/lib/dsr1d/bin)", "path"),
    "engine_embeddings": option(boolean, "serve a dedicated embedding model: /v1/embeddings "
                                "answers, generation does not (llama-server's --embeddings)",
                                "bool"),
    "aliases": option(word_list, "more names requests may give as \"model\" (the file's "
                      "stem always works)", "names"),
    "engine_cache_dir": option(_absolute, "where Hugging Face directories are converted to GGUF "
                               "for llama.cpp, once", "path"),
    "engine_context": option(integer(0, 1 << 20), "llama.cpp context in tokens (0: the model's, "
                             "at most 16384)", "tokens"),
    "engine_mmap": option(boolean, "llama.cpp maps the file instead of reading the weights into "
                          "anonymous memory with huge pages (no: faster decode)", "bool"),
    "engine_dtype": option(choice(*ENGINE_DTYPES),
                           "weight precision (auto: bf16 on CPUs with native bf16, else fp32)",
                           "name"),
    "engine_threads": option(integer(0, 4096), "decode threads (0: one per physical core)",
                             "count"),
    "engine_cpus": option(parse_cpu_list_option, "CPUs the engine is pinned to (e.g. 0-15; "
                          "unset: all)", "cpu list"),
    "engine_profile": option(_single, "profile held while the engine generates", "name"),
    "engine_parallel": option(integer(1, 64), "llama.cpp: requests decoded together in one "
                              "batch (continuous batching), each with the whole context", "slots"),
    "engine_ping_timeout_s": option(_positive_float, "an engine that answers no health "
                                    "check for this long is killed and restarted", "s"),
    "engine_flash_attn": option(choice("auto", "on", "off"), "llama.cpp's flash attention "
                                "(auto: measured each way with the KV cache's types once per "
                                "model, build and machine, the fastest kept; the engine log says "
                                "which and why)", "name"),
    "engine_kv_type": option(choice("auto", "f16", "q8_0"), "the KV cache's type: q8_0 halves "
                             "its memory (long reasoning in less RAM) and rounds it; auto: "
                             "measured with engine_flash_attn, q8_0 kept only if faster",
                             "name"),
    "draft_model": option(_draft, "speculative decoding: a smaller model with the same "
                          "tokenizer (a .gguf file or a Hugging Face directory, e.g. "
                          "R1-Distill-Qwen-1.5B for the 7B-32B), or `ngram` to draft from the "
                          "text so far (prompt lookup); unset: off", "path|ngram"),
    "draft_max": option(integer(0, 64), "tokens drafted per step (0: llama-server's default, "
                        "3 for a draft model and 48 for n-grams; a profile's [engine] draft_max "
                        "overrides it)", "tokens"),
}


def _host_port(raw: str) -> str:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6), or empty: off."""
    if raw == "":
        return raw
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{raw!r} is not HOST:PORT (e.g. 127.0.0.1:8080)")
    return raw


def _path_or_empty(raw: str) -> str:
    return raw if raw == "" else _absolute(raw)


API_SCHEMA: Schema = {
    "socket": option(_path_or_empty, "the OpenAI-compatible API's unix socket, mode 0660, group "
                     "dsr1d (default <root>/run/dsr1d/api.sock; empty: none)", "path"),
    "tcp": option(_host_port, "also listen on HOST:PORT, every request with an API key "
                  "(empty, the default: no TCP)", "host:port"),
    "api_keys_file": option(_path_or_empty, "the API keys TCP callers send as `Authorization: "
                            "Bearer KEY`, one a line, in a root-only file", "path"),
    "queue": option(integer(0, 4096), "requests that may wait for the engine; more get 429",
                    "count"),
    "connections": option(integer(8, 65536), "connections the API holds at once, idle or not; "
                          "more are closed at accept (root on the unix socket has 64 more)",
                          "count"),
    "connections_per_client": option(integer(1, 65536), "connections one TCP address or one "
                                     "local uid may hold (root on the unix socket: no limit)",
                                     "count"),
    "textfile": option(_path_or_empty, "also write the metrics to this .prom file (atomically, "
                       "every telemetry sample) for node_exporter's textfile collector", "path"),
}
SECTIONS = {"daemon": DAEMON_SCHEMA, "api": API_SCHEMA}


@dataclass
class Config:
    """The daemon's settings, defaults filled in."""

    path: Path | None = None
    default_profile: str = "sustained"
    telemetry_interval_s: float = 1.0
    root: str = "/"
    journal: str | None = None
    profiles_dir: str | None = None
    model: str | None = None
    engine_dtype: str = "auto"
    engine_backend: str = "auto"
    engine_cache_dir: str = "/var/cache/dsr1d"
    engine_context: int = 0
    engine_mmap: bool = False
    engine_threads: int = 0
    engine_cpus: list[int] | None = None
    engine_profile: str = "sustained"
    engine_parallel: int = 1
    engine_ping_timeout_s: float = 30.0
    engine_server: str = ""
    engine_embeddings: bool = False
    engine_flash_attn: str = "auto"
    engine_kv_type: str = "auto"
    draft_model: str = ""
    draft_max: int = 0
    aliases: list[str] = field(default_factory=list)
    api_socket: str | None = None           # None: <root>/run/dsr1d/api.sock
    api_tcp: str = ""
    api_keys_file: str = ""
    api_queue: int = 16
    api_connections: int = 512
    api_connections_per_client: int = 32
    api_textfile: str = ""


def load_config(path: Path | None) -> Config:
    """Read ``path`` (None or a missing default file: defaults); ProfileError when broken."""
    if path is None or (path == DEFAULT_PATH and not path.exists()):
        return Config(path=None)
    if not path.exists():
        raise ProfileError(path, 0, "no such file")
    sections = parse_ini(path)
    config = Config(path=path)
    for name, entries in sections.items():
        if name not in SECTIONS:
            raise ProfileError(path, section_line(path, name),
                               f"unknown section [{name}] (known: {', '.join(SECTIONS)})")
        prefix = "" if name == "daemon" else f"{name}_"
        for key, value in validate_section(name, entries, SECTIONS[name]).items():
            setattr(config, key if key.startswith(prefix) else prefix + key, value)
    if config.api_tcp and not config.api_keys_file:
        raise ProfileError(path, section_line(path, "api"),
                           "[api] tcp needs api_keys_file: no request over TCP goes unchecked")
    return config


def with_overrides(config: Config, root: str | None = None, journal: str | None = None,
                   profiles_dir: str | None = None) -> Config:
    """The command line over the config file, one rule for every command (``dsr1d run``,
    ``apply``, ``restore``…): ``--root`` moves the defaults under it, but a ``journal =`` or
    ``profiles_dir =`` the config sets still wins over those defaults; ``--journal`` and
    ``--profiles-dir`` win over both. So a restore after a crash, given the flags the daemon
    ran with, finds the daemon's journal."""
    return replace(config,
                   root=config.root if root is None else root,
                   journal=config.journal if journal is None else journal,
                   profiles_dir=config.profiles_dir if profiles_dir is None else profiles_dir)

