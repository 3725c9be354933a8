"""A disk memo of the profiled cost models' least-squares fits.

Fitting a profile takes milliseconds, but the solver's module (scipy.optimize) takes most
of a second to import, which every `deepinfer simulate` process paid before its first
step. A fit is a pure function of its inputs, the code that solves it and the libraries
and processor it runs on (the solver's BLAS picks its kernels by processor), so its
result is kept under the cache folder keyed by a digest of all of them, with a digest of
the result itself, and read back byte for byte: a hit returns exactly what solving again
on this host would, and a miss (a new profile, other code or versions, an entry that is
unreadable or fails its digest) solves and stores. The folder is `DEEPINFER_CACHE_DIR`,
else `$XDG_CACHE_HOME/deepinfer`, else `~/.cache/deepinfer`; where there is none or it
cannot be written, the fit is solved every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import CodeType

import numpy as np

from deepinfer import envs


def cache_dir() -> Path:
    """The folder that holds the memo (it may not exist yet). RuntimeError where no home
    folder can be found for the default."""
    configured = envs.cache_dir()
    if configured is not None:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "deepinfer"


def memo_solve(
    name: str,
    arrays: tuple[np.ndarray, ...],
    version: str,
    solve: Callable[[], np.ndarray],
) -> np.ndarray:
    """`solve()`, or its stored result for the same `name`, `arrays` (dtype, shape, memory
    order and bytes), solver `version`, `solve`'s own code and this host's processor."""
    digest = hashlib.sha256(
        f"{name}|{version}|{platform.machine()}|{platform.processor()}".encode()
    )
    _digest_code(digest, solve.__code__)
    for a in arrays:
        order = "C" if a.flags.c_contiguous else "F" if a.flags.f_contiguous else "strided"
        digest.update(f"|{a.dtype.str}{a.shape}{order}|".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    try:
        path = cache_dir() / "fits" / f"{name}-{digest.hexdigest()[:32]}.npz"
    except (RuntimeError, OSError):  # no home folder to put it under
        return solve()
    try:
        with np.load(path, allow_pickle=False) as stored:
            result, check = stored["result"], stored["digest"].tobytes()
        if check == hashlib.sha256(result.tobytes()).digest():
            return result
    except Exception:  # absent, cut short or damaged: solved again below
        pass
    result = solve()
    _store(path, result)
    return result


def _digest_code(digest: hashlib._Hash, code: CodeType) -> None:
    """Feed `code`'s instructions, names and constants to `digest`, nested code (a
    comprehension, an inner function) by its own content, never by its address."""
    digest.update(code.co_code + repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, CodeType):
            _digest_code(digest, const)
        else:
            digest.update(repr(const).encode())


def _store(path: Path, result: np.ndarray) -> None:
    """Write the entry whole, then rename it into place: a concurrent reader sees the old
    file or the new one, and a crash leaves at worst a temporary file."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        check = np.frombuffer(hashlib.sha256(result.tobytes()).digest(), dtype=np.uint8)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, result=result, digest=check)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
