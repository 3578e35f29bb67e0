"""Memory placement for a process: NUMA policy through set_mempolicy(2), the one call into the
real kernel the placement needs. A shared leaf (it imports nothing of dsr1d): the engine host
calls it in the child before it execs llama-server, and the core's placement names it."""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import platform

# <linux/mempolicy.h>
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_PREFERRED_MANY = 5  # Linux 5.15+

# set_mempolicy(2) has no glibc wrapper (it lives in libnuma), so it is called by number.
SET_MEMPOLICY_SYSCALL = {
    "x86_64": 238,
    "aarch64": 237,
    "riscv64": 237,
    "loongarch64": 237,
    "ppc64le": 261,
    "ppc64": 261,
    "s390x": 270,
}


def bind_memory(nodes: list[int]) -> str | None:
    """Place this process's future memory on ``nodes``; an error sentence instead of raising.

    Call it in the worker before the weights are loaded and before torch starts its threads
    (the policy is per thread and inherited by threads created later; pages already allocated
    are not moved). An empty list does nothing.

    The policy is *preferred*, not *bind*: a model that does not fit one node's memory spills
    to the other nodes (slower, but it runs) where MPOL_BIND would have the worker OOM-killed.
    One node uses MPOL_PREFERRED; several use MPOL_PREFERRED_MANY, or MPOL_INTERLEAVE on
    kernels before 5.15 (which also falls back to other nodes when its nodes are full).
    """
    if not nodes:
        return None
    if min(nodes) < 0:
        return f"cannot bind memory to nodes {nodes}: a node number is negative"
    number = SET_MEMPOLICY_SYSCALL.get(platform.machine())
    if number is None:
        return f"cannot bind memory: set_mempolicy is not known on {platform.machine()}"
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (max(nodes) // bits + 1))()
    for node in set(nodes):
        mask[node // bits] |= 1 << (node % bits)
    # The kernel drops the last bit of maxnode (a historical off-by-one), hence the + 1.
    maxnode = len(mask) * bits + 1
    modes = ([(MPOL_PREFERRED, "MPOL_PREFERRED")] if len(set(nodes)) == 1 else
             [(MPOL_PREFERRED_MANY, "MPOL_PREFERRED_MANY"), (MPOL_INTERLEAVE, "MPOL_INTERLEAVE")])
    libc = ctypes.CDLL(None, use_errno=True)
    err = 0
    name = ""
    for mode, name in modes:
        if libc.syscall(ctypes.c_long(number), ctypes.c_int(mode), mask,
                        ctypes.c_ulong(maxnode)) == 0:
            return None
        err = ctypes.get_errno()
        if err != errno_mod.EINVAL or mode != MPOL_PREFERRED_MANY:
            break
    return (f"set_mempolicy({name}, nodes {','.join(map(str, sorted(set(nodes))))}) failed: "
            f"{errno_mod.errorcode.get(err, str(err))} ({os.strerror(err)})")
