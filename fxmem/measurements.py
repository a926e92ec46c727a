"""The side effects of measuring CPU kernels' temporaries: the child process that measures them
and the cache file that keeps them across processes (:mod:`fxmem.graph.measured` decides what to
measure and how a measurement scales).

Both hold facts about this machine (torch's version, the thread count, oneDNN's choices), never a
compile's results, and neither may fail a compile:

- the cache, ``$FXMEM_CACHE/scratch.json`` (default ``~/.cache/fxmem/scratch.json``; a blank
  ``FXMEM_CACHE`` is unset), is validated on read: anything but a regular file holding a JSON
  object is ignored with a warning (a named pipe is never waited on), and so is every entry that
  is not a whole number of bytes in [0, :data:`MAX_BYTES`], or more than its op can plausibly
  allocate (:func:`fxmem.graph.measured.plausible_max`); those configurations are measured again;
- writers merge: under a lock file, a process re-reads the cache, adds its entries and replaces
  the file atomically (a temporary file, then ``os.replace``), so concurrent processes keep each
  other's entries; nothing is written through a symbolic link (a linked or non-regular lock file
  is refused: the cache is not written);
- a cache that cannot be read or written (``FXMEM_CACHE`` names a file, a read-only folder) logs
  one warning per process and the measurements stay in memory;
- a child that fails, or answers anything but one valid number per configuration, logs a warning
  and its configurations count as 0 in this process (not cached).

``FXMEM_MEASURE_SCRATCH=0`` (or false/no/off) turns measuring off: the temporaries count as 0.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from fxmem_kernels._common import env_flag

from .options import ENV_CACHE, ENV_MEASURE, env_value

log = logging.getLogger("fxmem")
MAX_BYTES = 2**50  # 1 PiB: above any kernel's temporary; a larger number is a corrupt entry
_CHILD = Path(__file__).with_name("_measure_child.py")


def enabled() -> bool:
    """Whether to measure (``FXMEM_MEASURE_SCRATCH``, default on)."""
    return env_flag(ENV_MEASURE, os.environ.get(ENV_MEASURE), default=True)


def cache_file() -> Path:
    """``$FXMEM_CACHE/scratch.json``; ``~/.cache/fxmem/scratch.json`` when it is unset or blank."""
    return Path(env_value(ENV_CACHE) or Path.home() / ".cache" / "fxmem") / "scratch.json"


def valid(value: Any) -> bool:
    """A measurement as the cache and the child must give it: whole bytes in [0, MAX_BYTES]."""
    return type(value) is int and 0 <= value <= MAX_BYTES


def read(path: Path) -> dict[str, int]:
    """The valid entries of the cache file at ``path``; {} when it is missing or unusable. Only a
    regular file is read: anything else (a named pipe would block ``open`` forever) is ignored."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError("not a regular file; allowed: a regular file, or none")
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON
        _warn_once(f"fxmem: ignoring the kernel measurement cache {path} ({type(e).__name__}: {e}); "
                   "its configurations are measured again")
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and valid(v)}


def write(path: Path, entries: dict[str, int]) -> None:
    """Add ``entries`` to the cache file at ``path``, keeping what other processes wrote."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(path.name + ".lock")):
            merged = {**read(path), **{k: v for k, v in entries.items() if valid(v)}}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(merged, f, sort_keys=True)
            os.replace(tmp, path)
            tmp = None
    except OSError as e:
        _warn_once(f"fxmem: cannot write the kernel measurement cache {path} ({type(e).__name__}: {e}); "
                   "keeping the measurements in memory")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``lock`` (POSIX; elsewhere, no lock: the merge alone).
    Never through a link or onto anything but a regular file: that would create or lock a file
    outside the cache folder."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise OSError(e.errno, f"the lock file {lock} is a symbolic link; allowed: a regular file, "
                                   "or none") from None
        raise
    with os.fdopen(fd, "rb"):
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"the lock file {lock} is not a regular file; allowed: a regular file, or none")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def measure(configs: dict[str, Any]) -> dict[str, int]:
    """Bytes per configuration (cache key -> JSON config of one op call), measured in one child
    process and added to the cache file; all 0 (not cached) when the child fails."""
    log.info("fxmem: measuring the CPU temporaries of %d kernel configuration(s)", len(configs))
    payload = json.dumps({"threads": torch.get_num_threads(), "configs": list(configs.values())})
    try:
        done = subprocess.run([sys.executable, str(_CHILD)], input=payload, capture_output=True, text=True,
                              timeout=600, check=True)
        results = json.loads(done.stdout.strip().splitlines()[-1])
        if not (isinstance(results, list) and len(results) == len(configs) and all(map(valid, results))):
            raise ValueError(f"expected {len(configs)} byte counts, got {done.stdout.strip()[-200:]!r}")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        log.warning("fxmem: could not measure kernel temporaries (%s); counting them as 0", e)
        return dict.fromkeys(configs, 0)
    found = dict(zip(configs, results))
    write(cache_file(), found)
    return found


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)
