"""Processes that save with dckpt.torch and exit at once exit cleanly: dckpt's gloo group is
destroyed (its worker threads joined) before the interpreter finalises, so no gloo worker
is left waiting for the GIL to drop a finished collective's work (an abort, `terminate
called without an active exception`, in about one run in twenty on a loaded machine)."""

from __future__ import annotations

import os
import tempfile

import torch

from conftest import free_port


def _save_and_exit(rank: int, world: int, port: int, root: str, destroy: bool) -> None:
    # Not conftest's `_entry`: it gives torch's own default-group workers time at exit,
    # which would hide the same race in dckpt's group.
    import torch.distributed as dist

    import dckpt.torch as dt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    w = torch.arange(8, dtype=torch.float32)
    dt.save({"w": dt.Shard(w[4 * rank : 4 * rank + 4].clone(), (8,), (4 * rank,)), "step": 3}, root)
    target = {"w": torch.zeros(8), "step": None}
    dt.load(target, root)
    if not (torch.equal(target["w"], w) and target["step"] == 3):
        raise SystemExit(3)
    # A script that tears torch.distributed down first and one that just returns: the
    # process exits straight after dckpt's last collective either way.
    if destroy:
        dist.destroy_process_group()
        # The race is rare; what prevents it is not: once torch's groups are destroyed,
        # dckpt's exit hook leaves no gloo worker behind (torch names them on Linux).
        if "pt_gloo_runloop" not in _thread_names():
            raise SystemExit(4)
        dt._shutdown()
        if "pt_gloo_runloop" in _thread_names():
            raise SystemExit(5)


def _thread_names() -> list[str]:
    names = []
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read().strip())
    return names


def test_two_rank_saves_exit_cleanly():
    import torch.multiprocessing as mp

    failures = []
    # The abort is rare; the thread checks (exit codes 4 and 5) are not, so two runs of
    # each way suffice (spawned, not forked: the interpreter's own exit is under test).
    for i in range(4):
        with tempfile.TemporaryDirectory(prefix="dckpt-exit-") as work:
            root = os.path.join(work, "ckpt")
            try:
                mp.start_processes(
                    _save_and_exit, args=(2, free_port(), root, i % 2 == 0), nprocs=2, start_method="spawn"
                )
            except Exception as e:  # ProcessExitedException: which rank, which signal or code
                failures.append(f"run {i}: {e}")
    # Exit code 4: dckpt's group had no workers to join; 5: they outlived the exit hook.
    assert failures == []
