"""Ranks as processes for the tests: `run_ranks(fn, world, *args)` starts `world` processes,
joins them into a gloo job on a free loopback port, runs `fn(rank, world, *args)` in each and
returns what each returned, in rank order.

The processes are forked from a fork server that imported torch and dckpt.torch once
(`start_ranks`): a spawned process spends about 4 s of CPU importing them, and most tests
are a few such processes doing milliseconds of work. Each rank is still a fresh process
with no group, checkpointer or thread of an earlier test; it is given the environment of
the test that started it, not the server's, and it exits without running `atexit` hooks
(multiprocessing's forked children end in `os._exit`): tests of the exit itself start their
processes with `spawn`."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import pytest
import torch


def pytest_sessionfinish(session, exitstatus) -> None:
    """Under `cargo xtask test` (DCKPT_NO_SKIPS=1) every test runs: the S3 server, torch,
    Megatron-Core and the dckpt binary are all there, so a test that skipped (an
    `importorskip`, a missing server) fails the run instead of passing it quietly."""
    if not os.environ.get("DCKPT_NO_SKIPS"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        for r in skipped:
            print(f"\nskipped under DCKPT_NO_SKIPS: {r.nodeid}: {r.longrepr}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out_dir: str, args: tuple, env: dict) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    # Two cores for everyone: one thread per rank keeps the ranks from starving each other.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # reported to the test, which fails naming the rank
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


# What every rank imports anyway; a module the server cannot import is left to the ranks.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "dckpt.torch"]


def start_ranks(fn, world: int, out_dir: str, args: tuple, join: bool = True):
    """`torch.multiprocessing.start_processes` of `world` ranks running `fn` through
    `_entry`, forked from the fork server (started by the first call, with `_PRELOAD`
    imported)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(_PRELOAD)
    return mp.start_processes(
        _entry,
        args=(fn, world, free_port(), out_dir, args, dict(os.environ)),
        nprocs=world,
        start_method="forkserver",
        join=join,
    )


def run_ranks(fn, world: int, *args):
    with tempfile.TemporaryDirectory(prefix="dckpt-ranks-") as out_dir:
        start_ranks(fn, world, out_dir, args)
        outcomes = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                outcomes.append(pickle.load(f))
    for r, (status, value) in enumerate(outcomes):
        if status != "ok":
            pytest.fail(f"rank {r} of {world} failed: {value}")
    return [value for _, value in outcomes]


def gen(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs included) of `dtype`, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def wait_child(pid: int, timeout: float = 60.0) -> int:
    """The exit code of a forked child, which is killed (and reported as -9) if it is not
    done within `timeout` seconds: a child that hangs must fail the test, not stall it."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


def caught(f, *args, **kwargs):
    """`(exception type name, message, rank attribute)` of what `f` raised, or None."""
    try:
        f(*args, **kwargs)
    except Exception as e:
        return (type(e).__name__, str(e), getattr(e, "rank", None))
    return None
