"""The live gauges of ``GET /metrics`` from the daemon's status (the edge's Metrics alone)."""

from __future__ import annotations

from typing import Any

from dsr1d.edges.metrics import Metrics


def scrape(status: dict[str, Any]) -> dict[str, float]:
    text = Metrics(lambda: status).exposition()[0].decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_energy_per_token_with_and_without_dram() -> None:
    got = scrape({"tokens_per_s": 20.0, "decoding": True,
                  "sample": {"pkg_power_w": 200.0, "ram_power_w": 40.0}})
    assert got["dsr1d_energy_per_token_joules"] == 10.0
    assert got["dsr1d_dram_power_watts"] == 40.0
    assert got["dsr1d_energy_per_token_with_dram_joules"] == 12.0


def test_no_dram_figure_where_the_machine_reports_none_and_no_energy_when_idle() -> None:
    got = scrape({"tokens_per_s": 20.0, "decoding": True, "sample": {"pkg_power_w": 200.0}})
    assert "dsr1d_dram_power_watts" not in got
    assert "dsr1d_energy_per_token_with_dram_joules" not in got
    idle = scrape({"tokens_per_s": 0.0, "decoding": False,
                   "sample": {"pkg_power_w": 60.0, "ram_power_w": 10.0}})
    assert idle["dsr1d_dram_power_watts"] == 10.0
    assert "dsr1d_energy_per_token_joules" not in idle
    assert "dsr1d_energy_per_token_with_dram_joules" not in idle
