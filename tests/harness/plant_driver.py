"""The thermal plant simulator stepped in real time against a fake root (tests and bench).

A thread reads the plant's controls (``scaling_max_freq``, PL1, …) from the files the daemon
writes and writes the plant's state where a real machine shows it, plus its decode tokens/s at
``sim/tokens_per_s``, which the ``plant_tokens`` test plugin reports as the engine's figure.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

from dsr1d.sim.plant import Plant, PlantParams, apply_controls, read_controls

TOKENS = "sim/tokens_per_s"


def plant_root(path: Path, profiles: dict[str, str], cpus: int = 4) -> Path:
    """An Intel fake root for the plant (TjMax 105 °C, no TCC offset: where the plant's TCC
    steps in) with ``profiles`` (name -> text) in its ``/etc/dsr1d/profiles``."""
    from fakeroot import intel_box          # tests/ is on the path wherever the harness is

    fake = intel_box(path, cpus=cpus)
    for cpu in range(cpus):
        fake.add_msr(cpu, 0x1A2, 105 << 16).add_msr(cpu, 0x19C, 0).add_msr(cpu, 0x1B1, 0)
    (fake.path / "etc/dsr1d/profiles").mkdir(parents=True)
    for name, text in profiles.items():
        (fake.path / f"etc/dsr1d/profiles/{name}.conf").write_text(text)
    return fake.path


class PlantDriver:
    """Steps the plant in a thread every ``period_s``: controls from the files, state into them.

    The plant is shrunk to ``cpus`` cores with the same package power and quick heat capacities,
    so a test sees minutes of thermal behaviour in seconds. ``lock`` guards the plant: hold it to
    change the plant's state from another thread (`inject_throttle`)."""

    def __init__(self, root: Path, params: PlantParams, cpus: int = 4,
                 period_s: float = 0.05) -> None:
        self.root = root
        self.period_s = period_s
        self.plant = Plant(replace(params, cores=cpus, c_eff_nf=params.c_eff_nf * 32 / cpus,
                                   c_sink_j_per_k=15.0, c_die_j_per_k=2.0))
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.write()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def write(self) -> None:
        """The plant's state into the fake root (atomically, file by file)."""
        self.plant.write_fake_root(self.root)
        tokens = self.plant.last.get("tokens_per_s", self.plant.tokens_per_s(self.plant.freq_ghz))
        (self.root / "sim").mkdir(exist_ok=True)
        (self.root / "sim/.tokens").write_text(f"{tokens:.4f}\n")
        (self.root / "sim/.tokens").replace(self.root / TOKENS)

    def inject_throttle(self, seconds: float = 0.2) -> None:
        """What the kernel shows after the hardware throttled for ``seconds``: one more event
        and more throttle time (the plant's own heat is left alone)."""
        with self.lock:
            self.plant.throttle_count += 1
            self.plant.throttle_s += seconds

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(self.period_s):
            now = time.monotonic()
            with self.lock:
                apply_controls(self.plant, read_controls(self.root))
                self.plant.step(now - last)
                self.write()
            last = now

    def __enter__(self) -> "PlantDriver":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
