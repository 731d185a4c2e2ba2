"""Spawned gloo ranks for multi-process tests: one fresh interpreter per world size runs every case.

A test module ``m`` defines ``worker(rank, world, group, data) -> dict`` and ends with
``if __name__ == "__main__": ranks_main(worker)``; its fixture calls ``spawn(m.__file__, world, tmp, data)``,
which runs ``python m.py OUTDIR WORLD`` (``torch.multiprocessing.spawn`` of ``world`` ranks on 127.0.0.1
with a free port, one torch thread each) and returns ``[data, result of rank 0, ...]``. A rank that raises
is reported with its traceback; a hung collective fails after ``timeout`` seconds instead of waiting.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

NEEDS_GLOO = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, outdir: str, worker, timeout: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    out = Path(outdir)
    try:
        result = worker(rank, world, dist.group.WORLD, torch.load(out / "data.pt"))
    except Exception:  # noqa: BLE001 - reported to the parent
        result = {"crash": traceback.format_exc()}
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def ranks_main(worker, timeout: int = 180) -> None:
    """The ``__main__`` of a test module: ``python module.py OUTDIR WORLD`` runs ``worker`` on WORLD ranks."""
    import torch.multiprocessing as mp

    outdir, world = sys.argv[1], int(sys.argv[2])
    mp.spawn(_rank, args=(world, free_port(), outdir, worker, timeout), nprocs=world, join=True)


def spawn(module_file: str, world: int, tmp: Path, data: dict) -> list:
    """Run ``module_file``'s worker on ``world`` ranks with ``data``; ``[data, rank 0's result, ...]``."""
    torch.save(data, tmp / "data.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, module_file, str(tmp), str(world)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = [torch.load(tmp / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return [data] + results


@contextmanager
def one_rank_group():
    """A world of one in this process (gloo): ``dist.group.WORLD``, destroyed on exit."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
