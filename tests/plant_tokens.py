"""A test telemetry plugin: the simulated plant's decode tokens/s as the engine's figure.

The daemon's end-to-end mitigation tests run no model; the plant driver writes the tokens/s its
decode model gives at the current clock to ``sim/tokens_per_s`` under the fake root, and this
source reports it under the engine's key (``DSR1D_PLUGINS=plant_tokens``).
"""

from __future__ import annotations

from typing import Any

from dsr1d.constants import ENGINE_TOKENS_PER_S
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.tunable import Support

PATH = "sim/tokens_per_s"


class PlantTokens:
    name = "plant_tokens"
    summary = "the simulated plant's decode tokens/s (tests only)"
    priority = 90

    def probe(self, root: Any) -> Support:
        return Support(root.exists(PATH), PATH)

    def read(self, root: Any, now: float) -> dict[str, Any]:
        return {ENGINE_TOKENS_PER_S: float(root.read(PATH))}


@hookimpl
def register_telemetry_sources(register: Any) -> None:
    register(PlantTokens())
