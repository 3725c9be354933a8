"""How many Triton kernel variants this process has compiled, over this package.

Every distinct combination of constexpr values and argument specialisations is a
compile (hundreds of milliseconds each). A served step must never pay one: the
executor compiles what serving needs at start-up, and the benchmarks and GPU tests
read this counter around steps to prove it.
"""

from __future__ import annotations

import sys
from typing import Any


def _jit_functions() -> list[Any]:
    """Every Triton JITFunction defined in an imported `kernels.*` module."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "kernels" or name.startswith("kernels.")):
            continue
        found.extend(v for v in vars(module).values() if isinstance(v, JITFunction))
    return found


def compiled_variants() -> dict[str, int]:
    """kernel name -> compiled variants in this process (all devices)."""
    counts: dict[str, int] = {}
    for fn in _jit_functions():
        caches = getattr(fn, "device_caches", {}) or {}
        n = 0
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            n += len(cache) if hasattr(cache, "__len__") else 0
        counts[fn.fn.__name__] = n
    return counts


def total_compiled() -> int:
    return sum(compiled_variants().values())
