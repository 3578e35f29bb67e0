"""One owner of the engine's thread count: the profile's wish and the mitigation controller's
cap combine in ``EngineHost.effective_threads``, so a profile change cannot lift a cap the
controller believes is in force (no worker needed: the decision is the host's). The host reads
a fake 4-core machine; this process's own CPUs bound it further."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dsr1d.edges.engine_host import EngineHost
from fakeroot import intel_box


@pytest.fixture
def host(tmp_path: Path) -> EngineHost:
    fake = intel_box(tmp_path / "root", cpus=4)
    made = EngineHost(Path("/nonexistent"), threads=0, root=str(fake.path))
    cores = min(4, len(os.sched_getaffinity(0)))
    assert made.threads == cores >= 2, "one thread per physical core of the placement"
    return made


def test_a_profile_change_keeps_the_controllers_cap(host: EngineHost) -> None:
    cores = host.threads

    async def scenario() -> list[int]:
        seen = []
        await host.set_thread_cap(1)
        seen.append(host.threads)
        await host.set_profile_threads(cores)   # a profile asks for more: the cap holds
        seen.append(host.threads)
        await host.set_thread_cap(None)         # the rung is released: the profile's count
        seen.append(host.threads)
        await host.set_profile_threads(1)
        seen.append(host.threads)
        return seen

    assert asyncio.run(scenario()) == [1, 1, cores, 1]


def test_never_more_threads_than_the_placements_cores_nor_fewer_than_one(
        host: EngineHost) -> None:
    cores = host.threads

    async def scenario() -> tuple[int, int]:
        await host.set_profile_threads(64)
        many = host.threads
        await host.set_thread_cap(0)
        return many, host.threads

    assert asyncio.run(scenario()) == (cores, 1)
