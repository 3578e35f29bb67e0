"""The bytes a decoded token reads (weights and KV cache), as the daemon publishes them for the
power controller: ``engine_gb_per_token`` in each telemetry sample and the
``dsr1d_engine_bytes_per_token`` gauge, from llama-server's ``/slots``.

The formula and its parts are checked on their own; then the real daemon serving SmolLM2 on
llama-server shows, during one long streamed answer, a figure at least the weights' that grows
with the context, and none once the engine is idle again.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import BusClient, eventually  # noqa: E402
from engine_fixtures import EngineDaemon, api_daemon_running  # noqa: E402

from dsr1d.constants import ENGINE_GB_PER_TOKEN  # noqa: E402
from dsr1d.core.mitigator import to_observation  # noqa: E402
from dsr1d.edges.engine_command import ServerSpec, kv_bytes_per_token  # noqa: E402
from dsr1d.edges.engine_host import bytes_per_token  # noqa: E402
from dsr1d.edges.metrics import Metrics  # noqa: E402

pytest_plugins = ["engine_fixtures"]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
GAUGE = "dsr1d_engine_bytes_per_token"


def slot(context: int, decoded: int, busy: bool = True) -> dict[str, Any]:
    """One entry of llama-server's ``/slots`` (the fields the figure reads)."""
    return {"id": 0, "n_ctx": 2048, "is_processing": busy, "n_prompt_tokens": context,
            "next_token": [{"has_next_token": busy, "n_decoded": decoded}]}


# -- the formula ---------------------------------------------------------------------------------

def test_the_weights_are_shared_by_the_decoding_slots_and_each_adds_its_cache() -> None:
    weights, kv = 1_000_000, 100.0
    assert bytes_per_token([slot(300, 200)], weights, kv) == weights + 100 * 300
    both = bytes_per_token([slot(300, 200), slot(100, 1)], weights, kv)
    assert both == (weights + 100 * 400) / 2


def test_idle_slots_and_slots_still_reading_their_prompt_count_for_nothing() -> None:
    weights, kv = 1_000_000, 100.0
    idle = [slot(0, 0, busy=False), {"id": 1, "n_ctx": 2048, "is_processing": False},
            slot(438, 0, busy=False)]
    assert bytes_per_token([], weights, kv) is None
    assert bytes_per_token(idle, weights, kv) is None
    assert bytes_per_token(idle + [slot(5000, 0)], weights, kv) is None   # its prompt only
    assert bytes_per_token(idle + [slot(300, 200), slot(5000, 0)], weights, kv) == \
        weights + 100 * 300


def test_the_kv_cache_bytes_follow_its_types() -> None:
    spec = ServerSpec(Path("m.gguf"), Path("s"), 2, 2048)
    assert kv_bytes_per_token(spec, 5760) == 5760 * 4                      # K and V f16
    q8 = replace(spec, kv_type="q8_0", flash_attn="on")
    assert kv_bytes_per_token(q8, 5760) == 5760 * 2 * 34 / 32
    k_only = replace(q8, flash_attn="off")                                 # V stays f16
    assert kv_bytes_per_token(k_only, 5760) == 5760 * (34 / 32 + 2)


def test_the_weights_a_token_reads_leave_out_an_embedding_table_not_used_as_output(
        smollm2: Path) -> None:
    from dsr1d.engine.gguf_file import decode_weight_bytes, inspect_gguf, kv_elements

    info = inspect_gguf(smollm2)
    assert info.tied_output and decode_weight_bytes(info) == info.tensor_bytes
    untied = replace(info, tied_output=False)
    assert decode_weight_bytes(untied) == info.tensor_bytes - info.embedding_bytes > 0
    assert kv_elements(info) == 30 * 3 * 64           # SmolLM2-135M: layers, KV heads, head


def test_the_sample_reaches_the_controller_and_the_gauge() -> None:
    assert to_observation({ENGINE_GB_PER_TOKEN: 15.5}, 0.0).gb_per_token == 15.5
    assert to_observation({}, 0.0).gb_per_token is None
    decoding = Metrics(status=lambda: {"sample": {ENGINE_GB_PER_TOKEN: 0.1234}})
    assert gauge(decoding.exposition()[0].decode()) == pytest.approx(123_400_000)
    assert gauge(Metrics(status=lambda: {"sample": {}}).exposition()[0].decode()) is None


def gauge(text: str) -> float | None:
    """The gauge's value in a Prometheus text, None where it is not there."""
    for line in text.splitlines():
        if line.startswith(GAUGE + " "):
            return float(line.split()[1])
    return None


# -- the real daemon -----------------------------------------------------------------------------

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def served(smollm2: Path, socket_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineDaemon]:
    with api_daemon_running(tmp_path_factory.mktemp("bpt"), smollm2, socket_dir,
                            engine=("engine_context = 2048",)) as daemon:
        yield daemon


def telemetry(bus: BusClient) -> dict[str, Any]:
    return {k: v.value for k, v in bus.call("GetTelemetry").body[0].items()}


def test_a_long_answer_reads_more_per_token_as_its_context_grows(
        served: EngineDaemon, socket_dir: Path, smollm2: Path) -> None:
    from dsr1d.engine.gguf_file import decode_weight_bytes, inspect_gguf, kv_elements

    info = inspect_gguf(smollm2)
    weights, kv = decode_weight_bytes(info), kv_elements(info) * 4   # f16 K and V
    bus = served.client()
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_dir / "api.sock")),
                        timeout=120)
    client = openai.OpenAI(api_key="unused", base_url="http://dsr1d/v1", http_client=http,
                           max_retries=0)
    seen: list[float] = []
    during: float | None = None
    asked = 0.0
    with client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=1500, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) as stream:
        for _ in stream:
            if time.monotonic() - asked < 0.2:
                continue
            asked = time.monotonic()
            value = telemetry(bus).get(ENGINE_GB_PER_TOKEN)
            if value is not None and (not seen or value != seen[-1]):
                seen.append(value)
                during = during or gauge(http.get("http://dsr1d/metrics").text)
            if len(seen) >= 3:
                break          # the stream closed: the request is cancelled
    assert len(seen) >= 3, f"the figure during the answer: {seen}"
    assert all(weights <= gb * 1e9 <= weights + kv * 2048 for gb in seen), (seen, weights, kv)
    assert seen == sorted(seen) and seen[-1] > seen[0], seen
    assert during is not None and during >= weights
    eventually(lambda: ENGINE_GB_PER_TOKEN not in telemetry(bus), timeout=10,
               what="no bytes per token once the engine is idle")
    assert gauge(http.get("http://dsr1d/metrics").text) is None
