"""torch's own gloo exit race, without dckpt: two ranks on gloo run `dcp.save`, call
`destroy_process_group()` and exit; on a loaded machine about one run in twenty aborts
with `terminate called without an active exception`.

Why: a ProcessGroupGloo worker drops its reference to a finished work after the caller's
wait returned, and releasing the work's tensors takes the GIL; a worker that gets the GIL
only while the interpreter finalises is ended by Python inside a noexcept destructor.

    python scripts/repro_gloo_exit_abort.py [RUNS] [SLEEP_S]

SLEEP_S > 0 sleeps that long after destroy_process_group (what python/tests/conftest.py
does), which gives the workers the GIL first. Prints how many runs failed."""

from __future__ import annotations

import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, root: str, sleep_s: float) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dcp.save({"x": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(root))
    dist.destroy_process_group()
    if sleep_s > 0:
        time.sleep(sleep_s)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    failed = 0
    for i in range(runs):
        try:
            mp.start_processes(_rank, args=(2, _free_port(), tempfile.mkdtemp(), sleep_s), nprocs=2, start_method="spawn")
        except Exception as e:  # ProcessExitedException naming the rank and the signal
            failed += 1
            print(f"run {i}: {e}", file=sys.stderr)
    print(f"{failed} of {runs} runs failed (sleep {sleep_s} s)")


if __name__ == "__main__":
    main()
