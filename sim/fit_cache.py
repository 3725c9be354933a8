"""A disk memo of the profiled cost models' least-squares fits.

Fitting a profile takes milliseconds, but the solver's module (scipy.optimize) takes most
of a second to import, which every `deepinfer simulate` process paid before its first
step. A fit is a pure function of its inputs and the solver's version, so its result is
kept under the cache folder keyed by a digest of both, and read back byte for byte: a
hit returns exactly what the solver would, and a miss (a new profile, another scipy, an
unreadable file) solves and stores. The folder is `DEEPINFER_CACHE_DIR`, else
`$XDG_CACHE_HOME/deepinfer`, else `~/.cache/deepinfer`; where it cannot be written, the
fit is solved every time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from deepinfer import envs


def cache_dir() -> Path:
    """The folder that holds the memo (it may not exist yet)."""
    configured = envs.cache_dir()
    if configured is not None:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "deepinfer"


def memo_solve(
    name: str, arrays: tuple[np.ndarray, ...], version: str, solve: Callable[[], np.ndarray]
) -> np.ndarray:
    """`solve()`, or its stored result for the same `name`, `arrays` (dtype, shape and
    bytes) and solver `version`."""
    digest = hashlib.sha256(f"{name}|{version}".encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(f"|{a.dtype.str}{a.shape}|".encode())
        digest.update(a.tobytes())
    path = cache_dir() / "fits" / f"{name}-{digest.hexdigest()[:32]}.npy"
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        pass
    result = solve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a concurrent reader sees the old file or the new.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, result, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass
    return result
