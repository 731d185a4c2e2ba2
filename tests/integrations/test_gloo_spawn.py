"""``tests/_gloo.spawn_ranks``, the launcher of every multi-rank test: it fails fast and loud, never hangs.

Each test spawns 2 real gloo ranks (fresh interpreters, a few seconds each) running a function of this
module, and checks one promise of the launcher: the ranks' environment and group; a rank that raises
stops the other (blocked in a collective) at once, with the traceback; a hung rank is killed at the
deadline with its Python stack; a rank that skips teardown (no atexit handler runs: torch 2.6 once
hung there); a failed rendezvous starts the world again; the store's port stays bound (no race).
"""

from __future__ import annotations

import atexit
import errno
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _gloo import NEEDS_GLOO, RENDEZVOUS_FAILED, server_store, spawn_ranks

pytestmark = [NEEDS_GLOO, pytest.mark.slow]   # each test starts 2 interpreters (3-20 s)


def _report(rank: int, world: int, out: str) -> None:
    """Writes what the rank sees; registers an atexit handler that would leave a file behind."""
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    seen = (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_PORT"],
            dist.get_rank(), dist.get_world_size(), torch.get_num_threads(), x.item())
    torch.save(seen, Path(out) / f"seen{rank}.pt")
    atexit.register(lambda: (Path(out) / f"teardown{rank}").write_text("ran"))


def _raises_on_rank_1(rank: int, world: int, out: str) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")
    time.sleep(10_000)      # rank 0 waits (as in a collective whose partner never comes; gloo may see the
    # partner's socket close and fail too, which would make the first failure ambiguous)


def _waits_forever_on_rank_1(rank: int, world: int, out: str) -> None:
    if rank == 1:
        time.sleep(10_000)
    dist.all_reduce(torch.zeros(1))


def _fails_rendezvous_once(rank: int, world: int, out: str) -> None:
    """The first world's rank 0 leaves as a rank whose rendezvous failed; the next world succeeds."""
    marker = Path(out) / "first_world"
    if rank == 0 and not marker.exists():
        marker.write_text("gone")
        os._exit(RENDEZVOUS_FAILED)
    dist.all_reduce(torch.zeros(1))
    (Path(out) / f"done{rank}").write_text("ok")


def test_ranks_get_the_launcher_environment_and_skip_teardown(tmp_path):
    spawn_ranks(_report, 2, (str(tmp_path),), deadline=120)
    seen = [torch.load(tmp_path / f"seen{r}.pt") for r in range(2)]
    for r, (rank, world, local, port, grank, gworld, threads, total) in enumerate(seen):
        assert (rank, world, local, grank, gworld, threads, total) == (str(r), "2", str(r), r, 2, 1, 3.0)
        assert int(port) > 0 and port == seen[0][3]
    assert not list(tmp_path.glob("teardown*")), "a rank ran its interpreter teardown (atexit handlers)"


def test_a_rank_that_raises_stops_the_other_at_once(tmp_path, capfd):
    # the collective timeout and the deadline are far away: the error must be the raising rank's
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed \(exit code 3\)"):
        spawn_ranks(_raises_on_rank_1, 2, (str(tmp_path),), collective_timeout=300, deadline=300)
    err = capfd.readouterr().err
    assert "ValueError: rank one gives up" in err
    assert "_raises_on_rank_1" in err and "stacks of the ranks still running" in err   # rank 0's stack


def test_a_hung_rank_is_killed_at_the_deadline_with_its_stack(tmp_path, capfd):
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] of 2 hung"):
        spawn_ranks(_waits_forever_on_rank_1, 2, (str(tmp_path),), collective_timeout=300, deadline=15)
    err = capfd.readouterr().err
    assert err.count("_waits_forever_on_rank_1") >= 2, err[-3000:]    # both ranks' stacks


def test_a_failed_rendezvous_starts_the_world_again(tmp_path, capfd):
    spawn_ranks(_fails_rendezvous_once, 2, (str(tmp_path),), deadline=120)
    assert (tmp_path / "first_world").exists() and (tmp_path / "done0").exists() and (tmp_path / "done1").exists()
    assert "rendezvous failed (attempt 1); starting the world again" in capfd.readouterr().err


def test_a_rendezvous_that_keeps_failing_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="rank 0 of 2 failed .exit code 75, rendezvous"):
        spawn_ranks(_always_fails_rendezvous, 2, (str(tmp_path),), deadline=120, attempts=1)


def _always_fails_rendezvous(rank: int, world: int, out: str) -> None:
    if rank == 0:
        os._exit(RENDEZVOUS_FAILED)
    dist.all_reduce(torch.zeros(1))


def test_the_store_holds_its_port():
    """The old pattern released the port before rank 0 bound it; the store keeps it bound."""
    store = server_store(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(OSError) as e:
            s.bind(("127.0.0.1", store.port))
        assert e.value.errno == errno.EADDRINUSE
    del store
