"""Measuring and recording: the one home of every benchmark's clocks, memory counters and result files.

The ``flexgroup bench`` workloads and the scripts in ``benchmarks/`` measure with these, so two numbers
called the same are measured the same way:

- time: :func:`sync` (a device's queued work done), :func:`time_interleaved` (contenders in interleaved
  rounds, wall and process CPU seconds), :func:`interleaved_medians` (the same, as the medians a record
  keeps), :func:`median_seconds` (one step);
- memory held for backward: :class:`SavedForBackward` / :func:`saved_bytes` (what autograd saves while a
  forward runs), :class:`HeldForBackward` / :func:`held_peak` (the most it holds at any moment while
  forwards and backwards run);
- memory of the process and device: :func:`peak_rss_bytes`, :func:`rss_bytes`, :func:`cuda_peak`;
- records: :func:`environment` (versions, machine, threads), :func:`write_json`, :func:`finish_workload`;
- per rank: :func:`per_rank` (a measurement on each of W spawned gloo CPU processes, or on one fresh process).
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..verification.memory import status_bytes

__all__ = ["sync", "time_interleaved", "interleaved_medians", "median_seconds", "SavedForBackward", "saved_bytes",
           "HeldForBackward", "held_peak", "peak_rss_bytes", "rss_bytes", "cuda_peak", "environment", "write_json",
           "finish_workload", "per_rank"]


# ---------------------------------------------------------------------------------- time
def sync(device: torch.device | str) -> None:
    """Wait for ``device``'s queued kernels (CUDA); nothing on CPU. A clock read after it counts their work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(steps: dict[str, Callable[[], object]], repeats: int = 3, warmup: int = 1,
                     device: torch.device | str = "cpu", cpu_times: dict | None = None,
                     alternate: bool = False) -> dict[str, list[float]]:
    """Wall-clock seconds per call of each step, timed in interleaved rounds (every step once per round).

    Interleaving spreads load from other processes over all contenders instead of the one that
    happened to run while the machine was busy. When ``cpu_times`` is a dict it also receives the
    process CPU seconds (all threads) of each call: on a shared CPU machine that is far steadier
    than wall time (it does not count time spent descheduled). ``alternate``: every other round runs
    the steps in reverse order, so no step always runs after the same one (caches, allocator state).
    """
    device = torch.device(device)
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    sync(device)
    out: dict[str, list[float]] = {n: [] for n in steps}
    if cpu_times is not None:
        cpu_times.update({n: [] for n in steps})
    for r in range(repeats):
        for n, fn in list(steps.items())[:: -1 if alternate and r % 2 else 1]:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            sync(device)
            out[n].append(time.perf_counter() - t0)
            if cpu_times is not None:
                cpu_times[n].append(time.process_time() - c0)
    return out


def interleaved_medians(steps: dict[str, Callable[[], object]], repeats: int = 3, warmup: int = 1,
                        device: torch.device | str = "cpu") -> dict[str, dict]:
    """:func:`time_interleaved`, kept as each step's record: ``median_s`` and ``times_s`` (wall seconds) and,
    on CPU, ``median_cpu_s`` and ``cpu_s`` (process CPU seconds; on CUDA CPU time measures nothing)."""
    cpu: dict | None = {} if torch.device(device).type == "cpu" else None
    times = time_interleaved(steps, repeats, warmup, device, cpu)
    out = {n: dict(median_s=statistics.median(t), times_s=t) for n, t in times.items()}
    for n, t in (cpu or {}).items():
        out[n].update(median_cpu_s=statistics.median(t), cpu_s=t)
    return out


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, cpu: bool = False) -> float:
    """The median seconds of one call of ``fn`` over ``repeats`` calls after ``warmup`` untimed ones: wall
    time, or process CPU time with ``cpu``."""
    cpu_times: dict = {}
    wall = time_interleaved({"fn": fn}, repeats, warmup, cpu_times=cpu_times)["fn"]
    return statistics.median(cpu_times["fn"] if cpu else wall)


# ---------------------------------------------------------------------------------- memory held for backward
def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data pointer, bytes)`` of ``t``'s storage; None for tensors without one (wrapper subclasses)."""
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


class SavedForBackward:
    """The distinct storages autograd saves for backward inside ``with SavedForBackward(...) as saved:``.

    ``exclude``: tensors whose storages are not counted (the parameters, inputs that exist anyway);
    ``kind(t) -> str`` labels each storage by the first tensor saved on it. After the block:
    :attr:`storages` (data pointer -> ``(bytes, kind)``), :attr:`bytes` and :meth:`by_kind`.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = (), kind: Callable[[torch.Tensor], str] | None = None):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.kind = kind
        self.storages: dict[int, tuple[int, str]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        found = _storage(t)
        if found is not None and found[0] not in self.skip:
            old = self.storages.get(found[0], (0, ""))
            self.storages[found[0]] = (max(old[0], found[1]), old[1] or (self.kind(t) if self.kind else ""))
        return t

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(n for n, _ in self.storages.values())

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, k in self.storages.values():
            out[k] = out.get(k, 0) + n
        return out


def saved_bytes(forward: Callable[[], torch.Tensor], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of distinct storages autograd saves for backward while ``forward()`` runs.

    The activation memory a backward pass must keep (parameters in ``exclude`` are not counted).
    Measurable on any device; on CUDA also see ``torch.cuda.max_memory_allocated``.
    """
    with SavedForBackward(exclude) as saved:
        out = forward()
    del out
    return saved.bytes


class HeldForBackward:
    """Bytes of distinct storages that autograd holds for backward right now (:attr:`live`), and the most
    it held (:attr:`peak`): the saved-tensor hooks of :func:`held_peak`, which count a storage from its
    first save to the release of its last saved tensor. Subclass and extend :meth:`pack` / :meth:`release`
    to see more (e.g. what is alive at the peak)."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.count: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t):
        found = _storage(t)
        if found is None or found[0] in self.skip:
            return t
        ptr, n = found
        if not self.count.get(ptr):
            self.live += n
            self.peak = max(self.peak, self.live)
        self.count[ptr] = self.count.get(ptr, 0) + 1
        return Held(t, ptr, n, self)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, Held) else h

    def release(self, ptr: int, n: int) -> None:
        self.count[ptr] -= 1
        if not self.count[ptr]:
            self.live -= n


class Held:
    """One saved tensor as :class:`HeldForBackward` keeps it: released (counted down) when autograd drops it."""

    __slots__ = ("t", "ptr", "n", "tracker")

    def __init__(self, t, ptr, n, tracker):
        self.t, self.ptr, self.n, self.tracker = t, ptr, n, tracker

    def __del__(self):
        self.tracker.release(self.ptr, self.n)


def held_peak(step: Callable[[], object], exclude: Sequence[torch.Tensor] = (),
              tracker: HeldForBackward | None = None) -> int:
    """Peak bytes held for backward while ``step()`` runs (forwards and backwards as the contender does);
    ``exclude``: the parameters. ``tracker``: a (subclassed) :class:`HeldForBackward` to use instead."""
    tr = tracker if tracker is not None else HeldForBackward(exclude)
    with torch.autograd.graph.saved_tensors_hooks(tr.pack, tr.unpack):
        step()
    return tr.peak


# ---------------------------------------------------------------------------------- process and device memory
def peak_rss_bytes() -> int:
    """Peak resident bytes of this process image (``VmHWM``; unlike ``ru_maxrss`` it does not inherit the
    parent's RSS across fork + exec); ``ru_maxrss`` where /proc is missing."""
    peak = status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """Resident bytes of this process now (``VmRSS``); raises where /proc is missing (Linux only)."""
    now = status_bytes("VmRSS")
    if now is None:
        raise OSError("/proc/self/status has no VmRSS: the resident size is read on Linux only")
    return now


def cuda_peak(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated on ``device`` during ``fn()`` above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# ---------------------------------------------------------------------------------- records
def environment(device: str = "cpu") -> dict:
    """What a result depends on besides the code: date, Python, platform, package versions, torch threads,
    the device (and the GPU's or CPU's name)."""
    import importlib.metadata as md

    vers = {}
    for pkg in ("torch", "transformers", "flexgroup", "prefix-grouper"):
        try:
            vers[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            vers[pkg] = None
    env = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), python=platform.python_version(),
               platform=platform.platform(), versions=vers, torch_threads=torch.get_num_threads(), device=device)
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def write_json(rec: dict, path: str | Path) -> None:
    """``rec`` as indented JSON at ``path`` (its folder made; values JSON cannot hold written as ``str``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")


def finish_workload(rec: dict, text: str, out: str | None) -> int:
    """A workload's end: print its table ``text``, write ``rec`` as JSON to ``out`` when given; exit status 0."""
    print(text)
    if out:
        write_json(rec, out)
    return 0


# ---------------------------------------------------------------------------------- per rank
def per_rank(measure: Callable[..., dict], args: tuple, world: int, tmp: str | Path) -> list[dict]:
    """``measure(*args, group=...)`` on each of ``world`` fresh CPU processes, in rank order: ``world > 1``
    spawns gloo ranks (127.0.0.1, one torch thread each) with ``group`` their process group, each saving its
    result under ``tmp``; ``world == 1`` runs ``measure(*args, group=None)`` (unsharded) in one fresh process.
    ``measure`` must be picklable (a module-level function, or a ``functools.partial`` of one)."""
    import socket

    import torch.multiprocessing as mp

    if world == 1:
        with mp.get_context("spawn").Pool(1) as pool:
            return [pool.apply(measure, args, {"group": None})]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, measure, args, str(tmp)), nprocs=world, join=True)
    return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


def _rank(rank: int, world: int, port: int, measure: Callable[..., dict], args: tuple, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(measure(*args, group=dist.group.WORLD), Path(tmp) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
