"""What the llama-cpp-python build in this environment is (dsr1d's own, which patches, what it
uses on this CPU). llama-cpp-python is the benches' and the numerical checks' way into the
same patched llama.cpp the engine's llama-server is built from; the engine does not import it.
"""

from __future__ import annotations

import ctypes

def installed() -> bool:
    """Whether llama-cpp-python can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def system_info() -> str:
    """What the llama.cpp build uses on this CPU (``AVX2 = 1 | AVX512 = 0 | …``)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def patches() -> list[str]:
    """The tools/llama-patches/ this llama.cpp build carries ([]: not the project's build)."""
    import llama_cpp.llama_cpp as bindings

    try:
        marker = bindings._lib.llama_dsr1d_patches
    except AttributeError:
        return []
    marker.restype = ctypes.c_char_p
    return marker().decode().split()


def amx_warning(info: str, applied: list[str]) -> str | None:
    """What to say about a build whose ``system_info`` shows AMX without the project's fix
    (``applied``: its `patches`): its int8 kernels crash on the first prompt of two or more
    tokens when GCC 12 built it at -O3, as pip does (llama.cpp #20824)."""
    if "AMX_INT8 = 1" not in info or "amx-tile-config" in applied:
        return None
    return ("warning: this llama.cpp build uses AMX without dsr1d's fix; its int8 kernels crash "
            "(SIGSEGV) on the first prompt when GCC 12 built them (llama.cpp #20824): "
            "make setup builds it with the fix (tools/llama-patches/)")


def build_info() -> str:
    """The binding's version, what its build uses here and its patches, or why it does not
    load."""
    try:
        import llama_cpp

        info, applied = system_info(), patches()
        warning = amx_warning(info, applied)
        return f"llama.cpp {llama_cpp.__version__}: {info}\npatches: " + \
            (", ".join(applied) or "none (not built by tools/llama-wheel.sh)") + \
            (f"\n{warning}" if warning else "")
    except (ImportError, OSError) as exc:  # a wheel built for another CPU, a missing library
        return f"llama-cpp-python is installed but does not load: {exc}"
