"""Spawned gloo ranks for multi-process tests: one fresh interpreter per world size runs every case.

A test module ``m`` defines ``worker(rank, world, group, data) -> dict`` and ends with
``if __name__ == "__main__": ranks_main(worker)``; its fixture calls ``spawn(m.__file__, world, tmp, data)``,
which runs ``python m.py OUTDIR WORLD`` and returns ``[data, result of rank 0, ...]``. Harnesses that
save their own files call :func:`spawn_ranks` directly.

:func:`spawn_ranks` (the robust core; every multi-rank test goes through it):

- **No port race.** This process binds the rendezvous store itself on port 0 (the OS picks a free
  port and it stays bound for the whole run; bound after the ranks start, so a forked rank never
  inherits its thread) and hands the port to the ranks, which connect to it as clients. The old pattern --
  find a free port, release it, let rank 0 bind it seconds later -- could lose the port to another
  process. A rank whose rendezvous still fails exits with :data:`RENDEZVOUS_FAILED`, and the whole
  world is started again (``attempts`` times).
- **No hang on a failed rank.** Collectives time out after ``collective_timeout`` seconds (120,
  not gloo's 30 minutes). When one rank exits non-zero, the others dump their Python stacks
  (``faulthandler`` on SIGUSR1) and are killed; the error names the rank and its exit code, and
  its traceback is on stderr. Past ``deadline`` every live rank dumps its stack and is killed.
- **No hang at teardown.** The process group is never destroyed by hand; a rank whose work
  returned waits for the others (a barrier), flushes its output and leaves with ``os._exit(0)``,
  skipping torch's teardown. In the oldest env (torch 2.6), ``tests/integrations/_trl_dist.py``'s
  ranks called ``destroy_process_group()`` while their last trainer (a DDP-wrapped model) was still
  alive; freeing it afterwards sometimes never returned: rank 1's main thread blocked in a futex as
  its worker's frame was freed (every result already saved, rank 0 gone) -- 1 of 19 runs, the cause
  of the CI timeout (which destructor blocks was not pinned down). Trainers freed mid-run, with the
  group still registered, never hung.

Each rank gets the environment ``torchrun`` / ``accelerate launch`` give (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and one torch thread, and starts with the
default process group initialised (gloo), so libraries that would initialise one reuse it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

NEEDS_GLOO = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

HOST = "127.0.0.1"
RENDEZVOUS_FAILED = 75      # a rank's exit code when it could not join the group (the world is restarted)
WORK_FAILED = 3             # a rank's exit code when its function raised (traceback on stderr)
SUBPROCESS_TIMEOUT = 360    # seconds a test waits for a harness process (spawn_ranks' deadline is shorter)


def free_port() -> int:
    """A port that was free a moment ago (racy: prefer :func:`server_store`, which holds its port)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_store(world: int, timeout: float = 60) -> dist.TCPStore:
    """A rendezvous store served by this process on a port the OS picked (``store.port``); no race."""
    return dist.TCPStore(HOST, 0, world_size=world, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


def _rank_entry(fn, rank: int, world: int, shared_port, collective_timeout: float, args: tuple) -> None:
    """One rank: join the group (exit RENDEZVOUS_FAILED if that fails), run ``fn``, barrier, ``os._exit``."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # the parent asks for stacks before a kill
    end = time.monotonic() + collective_timeout
    while shared_port.value == 0 and time.monotonic() < end:   # the parent binds the store after the start
        time.sleep(0.02)
    port = shared_port.value
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR=HOST, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    timeout = timedelta(seconds=collective_timeout)
    try:
        store = dist.TCPStore(HOST, port, world_size=world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception:  # noqa: BLE001 - reported, and the parent starts the world again
        print(f"rank {rank}: rendezvous on {HOST}:{port} failed:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        os._exit(RENDEZVOUS_FAILED)
    code = 0
    try:
        fn(rank, world, *args)
        if dist.is_initialized():
            dist.barrier()                      # nobody leaves while another rank may still need it
    except BaseException:  # noqa: BLE001 - reported to the parent by the exit code, traceback on stderr
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = WORK_FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                              # skip torch's teardown (see the module docstring)


def _stop(procs: dict, why: str) -> None:
    """Ask every live rank for its stack (stderr), then kill it."""
    alive = [p for p in procs.values() if p.is_alive()]
    if alive:
        print(f"spawn_ranks: {why}; stacks of the ranks still running follow", file=sys.stderr, flush=True)
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(1.0 if alive else 0)
    for p in alive:
        p.kill()
    for p in procs.values():
        p.join(5)


def spawn_ranks(fn, world: int, args: tuple = (), *, collective_timeout: float = 120, deadline: float = 300,
                attempts: int = 3, start_method: str = "spawn") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return when every rank succeeded.

    ``start_method="spawn"`` (fresh interpreters; ``fn`` must be a module-level function) or ``"fork"``
    (the ranks inherit this process's imports; call it before anything starts a thread pool).
    Raises ``RuntimeError`` naming the first rank that failed (its traceback is on stderr) or the ranks still running after ``deadline``
    seconds (their stacks are on stderr); a failed rendezvous starts the world again, ``attempts`` times.
    """
    import multiprocessing.connection as mp_connection

    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    for attempt in range(1, attempts + 1):
        port = ctx.Value("i", 0)
        procs = {r: ctx.Process(target=_rank_entry, args=(fn, r, world, port, collective_timeout, args),
                                daemon=False) for r in range(world)}
        for p in procs.values():
            p.start()
        store = server_store(world)
        port.value = store.port
        end = time.monotonic() + deadline
        failed: list[int] = []                  # ranks in the order their failure was seen
        try:
            while True:
                mp_connection.wait([p.sentinel for p in procs.values() if p.exitcode is None], timeout=0.5)
                codes = {r: p.exitcode for r, p in procs.items()}
                failed += [r for r, c in codes.items() if c not in (None, 0) and r not in failed]
                if failed:
                    r, c = failed[0], codes[failed[0]]
                    _stop(procs, f"rank {r} exited with code {c}")
                    if c == RENDEZVOUS_FAILED and attempt < attempts:
                        print(f"spawn_ranks: rendezvous failed (attempt {attempt}); starting the world again",
                              file=sys.stderr, flush=True)
                        break
                    raise RuntimeError(f"rank {r} of {world} failed (exit code {c}"
                                       f"{', rendezvous' if c == RENDEZVOUS_FAILED else ''}); "
                                       "its traceback is on stderr above")
                if all(c == 0 for c in codes.values()):
                    return
                if time.monotonic() > end:
                    hung = sorted(r for r, c in codes.items() if c is None)
                    _stop(procs, f"ranks {hung} still running after {deadline} s")
                    raise RuntimeError(f"ranks {hung} of {world} hung (still running after {deadline} s); "
                                       "their Python stacks are on stderr above")
        finally:
            _stop(procs, "stopping")
            del store


def _ranks_worker(rank: int, world: int, outdir: str, worker) -> None:
    out = Path(outdir)
    try:
        result = worker(rank, world, dist.group.WORLD, torch.load(out / "data.pt"))
    except Exception:
        torch.save({"crash": traceback.format_exc()}, out / f"rank{rank}.pt")
        raise                                   # this rank exits at once; the parent stops the others
    torch.save(result, out / f"rank{rank}.pt")


def ranks_main(worker, timeout: int = 120) -> None:
    """The ``__main__`` of a test module: ``python module.py OUTDIR WORLD`` runs ``worker`` on WORLD ranks."""
    outdir, world = sys.argv[1], int(sys.argv[2])
    spawn_ranks(_ranks_worker, world, (outdir, worker), collective_timeout=timeout)


def run_harness(argv: list[str], env: dict | None = None, timeout: int = SUBPROCESS_TIMEOUT) -> None:
    """Run ``python *argv`` (a harness that spawns ranks); fail with its output if it fails or hangs."""
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    try:
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        pytest.fail(f"{argv[0]} ran past {timeout} s:\n{out[-3000:]}\n{err[-8000:]}")
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"


def spawn(module_file: str, world: int, tmp: Path, data: dict) -> list:
    """Run ``module_file``'s worker on ``world`` ranks with ``data``; ``[data, rank 0's result, ...]``."""
    torch.save(data, tmp / "data.pt")
    run_harness([module_file, str(tmp), str(world)])
    results = [torch.load(tmp / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return [data] + results


@contextmanager
def one_rank_group():
    """A world of one in this process (gloo): ``dist.group.WORLD``, destroyed on exit."""
    store = server_store(1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
