"""What this process may still allocate, and how much a phase of work took: verify's memory budget.

:func:`flexgroup.verify` runs up to three models' worth of gradients beside the caller's model, and
its ``auto`` calibration adds a float64 truth. It sizes that from numbers read here, never from an
assumed multiple of the model:

- :func:`headroom`: bytes the process may still allocate -- the smallest of Linux's ``MemAvailable``,
  the address-space limit (``RLIMIT_AS``, what ``ulimit -v`` / ``prlimit`` set) minus the current
  virtual size, and the cgroup limit minus its usage (v2 ``memory.max``, v1 ``memory.limit_in_bytes``);
- :class:`Peak`: the peak resident set of one phase above its start (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``), i.e. the activations and temporaries it really took.

Both return None where the platform does not say (not Linux, a restricted ``/proc``); callers then
fall back to a stated default.
"""

from __future__ import annotations

import gc
import resource

__all__ = ["headroom", "Peak", "size", "status_bytes"]


def size(n: float) -> str:
    """``n`` bytes as GiB or MiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``VmSize``) in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None   # "max" (v2, no limit): None


def _cgroup_room() -> int | None:
    """The cgroup's limit minus its usage (v2, else v1), or None without a limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, used = _read_int(limit), _read_int(usage)
        if lim is not None and used is not None and lim < 2**60:   # v1 writes a huge number for "no limit"
            return max(lim - used, 0)
    return None


def headroom() -> tuple[int | None, str]:
    """``(bytes this process may still allocate, what bounds it)``; ``(None, why)`` where nothing says.

    The smallest of: ``MemAvailable``; ``RLIMIT_AS`` minus the current virtual size (``VmSize``); the
    cgroup's limit minus its usage. Garbage is collected first, so freed copies are not counted.
    """
    gc.collect()
    found: list[tuple[int, str]] = []
    avail = _meminfo_available()
    if avail is not None:
        found.append((avail, f"{size(avail)} of memory available"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    vm = status_bytes("VmSize")
    if soft != resource.RLIM_INFINITY and vm is not None:
        found.append((max(soft - vm, 0), f"{size(max(soft - vm, 0))} left under the address-space limit "
                                         f"(RLIMIT_AS {size(soft)}, {size(vm)} mapped)"))
    room = _cgroup_room()
    if room is not None:
        found.append((room, f"{size(room)} left under the cgroup's memory limit"))
    if not found:
        return None, "the memory available is unknown on this platform"
    return min(found)


class Peak:
    """The peak resident set of a phase above its start: ``with Peak() as p: ...; p.above_start``.

    Resets the process's high-water mark (``VmHWM``) on entry by writing ``5`` to
    ``/proc/self/clear_refs``; ``above_start`` is None where that is not possible. File-backed pages
    that became resident during the phase and stay (weights memory-mapped from a checkpoint, read for
    the first time) are not counted: they are the model, not the phase's work.
    """

    def __enter__(self) -> "Peak":
        gc.collect()
        self.start = status_bytes("VmRSS")
        self.file_start = status_bytes("RssFile") or 0
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.start = None
        self.above_start: int | None = None
        return self

    def read(self) -> int | None:
        """The peak so far above the start (bytes), or None where it cannot be measured."""
        hwm = status_bytes("VmHWM")
        if self.start is None or hwm is None:
            return None
        mapped = max((status_bytes("RssFile") or 0) - self.file_start, 0)
        return max(hwm - self.start - mapped, 0)

    def __exit__(self, *exc) -> None:
        self.above_start = self.read()
