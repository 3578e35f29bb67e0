"""Prometheus metrics for ``GET /metrics`` and the node_exporter textfile collector.

Names in node-exporter style, units in the name: ``dsr1d_requests_total{endpoint,code}``,
``dsr1d_first_token_seconds`` and ``dsr1d_inter_token_seconds`` (histograms),
``dsr1d_requests_active`` (running and queued), ``dsr1d_queue_depth``, ``dsr1d_slots_active``,
``dsr1d_decode_tokens_per_second``, ``dsr1d_engine_bytes_per_token`` (weights and KV cache a
decoded token reads, while decoding), ``dsr1d_profile_info{profile}``, ``dsr1d_holds``,
``dsr1d_throttle_state_info{state}``, ``dsr1d_mitigations_active``,
``dsr1d_package_temperature_celsius``, ``dsr1d_package_power_watts`` and
``dsr1d_energy_per_token_joules`` (package power over decode tokens/s, while decoding),
``dsr1d_dram_power_watts`` and ``dsr1d_energy_per_token_with_dram_joules`` (package and DRAM
power over decode tokens/s) where the machine reports DRAM power.

Counters: ``dsr1d_tokens_total`` and ``dsr1d_prompt_tokens_total`` (everything the engine
decoded and read, API and D-Bus alike, from llama-server's own counters),
``dsr1d_api_prompt_tokens_total`` / ``dsr1d_api_completion_tokens_total`` (the usage of API
requests), ``dsr1d_energy_joules_total`` (package energy while the engine decodes),
``dsr1d_engine_restarts_total``; ``dsr1d_engine_state_info{state}``, ``dsr1d_build_info`` and
``dsr1d_engine_info{flash_attn,kv_type,speculative}`` (once the engine has started).
llama-server's own series (``llamacpp:…``) follow on the API's ``/metrics``. Nothing of a
request's text is ever a label.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, \
    write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dsr1d.constants import ENGINE_GB_PER_TOKEN, PKG_POWER_W, PKG_TEMP_C, RAM_POWER_W

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
Status = Callable[[], dict[str, Any]]


class _Live:
    """Gauges read at scrape time from the daemon's state (``status()``)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.metrics.status()
        active = self.metrics.active_requests
        yield _gauge("dsr1d_requests_active", "generations running or queued", active)
        slots = self.metrics.slots
        yield _gauge("dsr1d_slots_active", "generations decoding now", min(active, slots))
        yield _gauge("dsr1d_slots", "generations the engine decodes together", slots)
        yield _gauge("dsr1d_queue_depth", "generations waiting for a slot",
                     max(0, active - slots))
        rate = float(s.get("tokens_per_s") or 0.0)
        yield _gauge("dsr1d_decode_tokens_per_second", "the engine's last decode rate", rate)
        sample = s.get("sample", {})
        if sample.get(ENGINE_GB_PER_TOKEN) is not None:
            yield _gauge("dsr1d_engine_bytes_per_token", "bytes a decoded token reads now "
                         "(weights and KV cache)", float(sample[ENGINE_GB_PER_TOKEN]) * 1e9)
        profile = GaugeMetricFamily("dsr1d_profile_info", "the active profile",
                                    labels=["profile"])
        profile.add_metric([str(s.get("profile", ""))], 1)
        yield profile
        yield _gauge("dsr1d_holds", "profile holds in force", len(s.get("holds", [])))
        state = GaugeMetricFamily("dsr1d_throttle_state_info", "the mitigation controller's "
                                  "state", labels=["state"])
        state.add_metric([str(s.get("throttle_state", "none"))], 1)
        yield state
        yield _gauge("dsr1d_mitigations_active", "mitigation actuators applied",
                     len(s.get("mitigations", [])))
        if sample.get(PKG_TEMP_C) is not None:
            yield _gauge("dsr1d_package_temperature_celsius", "package temperature",
                         float(sample[PKG_TEMP_C]))
        if sample.get(PKG_POWER_W) is not None:
            watts = float(sample[PKG_POWER_W])
            yield _gauge("dsr1d_package_power_watts", "package power", watts)
            if s.get("decoding") and rate > 0:
                yield _gauge("dsr1d_energy_per_token_joules", "package energy per decoded "
                             "token", watts / rate)
        if sample.get(RAM_POWER_W) is not None:
            dram = float(sample[RAM_POWER_W])
            yield _gauge("dsr1d_dram_power_watts", "DRAM power", dram)
            if sample.get(PKG_POWER_W) is not None and s.get("decoding") and rate > 0:
                # decode streams every weight from DRAM once a token: its share is real energy
                yield _gauge("dsr1d_energy_per_token_with_dram_joules", "package and DRAM "
                             "energy per decoded token", (float(sample[PKG_POWER_W]) + dram) / rate)
        yield from _engine_families(s)


def _engine_families(s: dict[str, Any]) -> Iterator[Any]:
    """The engine's counters, state and build, read at scrape time."""
    yield CounterMetricFamily("dsr1d_tokens", "tokens the engine generated",
                              value=float(s.get("tokens_total", 0)))
    yield CounterMetricFamily("dsr1d_prompt_tokens", "prompt tokens the engine read",
                              value=float(s.get("prompt_tokens_total", 0)))
    yield CounterMetricFamily("dsr1d_energy_joules", "package energy while the engine decoded",
                              value=float(s.get("energy_joules_total", 0.0)))
    yield CounterMetricFamily("dsr1d_engine_restarts", "llama-server (re)starts after the first",
                              value=float(s.get("engine_restarts", 0)))
    state = GaugeMetricFamily("dsr1d_engine_state_info", "the engine's state", labels=["state"])
    state.add_metric([str(s.get("engine_state", "unconfigured"))], 1)
    yield state
    build = GaugeMetricFamily("dsr1d_build_info", "dsr1d's version and the engine's build",
                              labels=["version", "engine_build"])
    build.add_metric([str(s.get("version", "")), str(s.get("engine_build", ""))], 1)
    yield build
    config = s.get("engine_config") or {}
    if config:
        info = GaugeMetricFamily("dsr1d_engine_info", "how the engine runs: flash attention and "
                                 "the KV cache's type (as measured or configured), speculative "
                                 "decoding", labels=list(config))
        info.add_metric([str(v) for v in config.values()], 1)
        yield info


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help, value=value)


class Metrics:
    """Counters and histograms the API updates, and the live gauges."""

    def __init__(self, status: Status = dict) -> None:
        self.status = status
        self.active_requests = 0
        self.slots = 1
        self.registry = CollectorRegistry()
        self.requests = Counter("dsr1d_requests", "API requests by endpoint and status code",
                                ["endpoint", "code"], registry=self.registry)
        self.first = Histogram("dsr1d_first_token_seconds", "request to first token",
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.between = Histogram("dsr1d_inter_token_seconds", "time between tokens",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.api_prompt = Counter("dsr1d_api_prompt_tokens", "prompt tokens of API requests",
                                  registry=self.registry)
        self.api_completion = Counter("dsr1d_api_completion_tokens", "tokens generated for API "
                                      "requests", registry=self.registry)
        self.registry.register(_Live(self))

    def request(self, endpoint: str, code: str) -> None:
        known = endpoint if endpoint in ENDPOINTS else "other"   # no unbounded label values
        self.requests.labels(known, code).inc()

    def active(self, n: int, slots: int = 1) -> None:
        self.active_requests, self.slots = n, slots

    def usage(self, prompt: int, completion: int) -> None:
        """One API request's usage, as the engine reported it."""
        self.api_prompt.inc(max(0, prompt))
        self.api_completion.inc(max(0, completion))

    def first_token(self, seconds: float) -> None:
        self.first.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.between.observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def write_textfile(self, path: str) -> None:
        """For node_exporter's textfile collector: written whole, then renamed."""
        write_to_textfile(path, self.registry)


ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
             "/v1/embeddings", "/tokenize", "/detokenize", "/props", "/slots")
