"""dckpt.torch.CheckpointManager on two ranks (gloo): one checkpoint per step, retention
after each commit (synchronous and background saves), the latest step loaded bit-exact in
another split, a second save into a step refused on every rank, and gc of a dead save."""

from __future__ import annotations

import os

import torch

import dckpt
import dckpt.torch as dt
from conftest import gen, run_ranks, same_bits

SHAPE = (8, 6)


def weight(step: int) -> torch.Tensor:
    return gen(SHAPE, torch.float32, 100 + step)


def state(rank: int, step: int) -> dict:
    # Rows split between the two ranks; a step counter every rank holds alike.
    w = weight(step)
    r0, r1 = (0, 4) if rank == 0 else (4, 8)
    return {"w": dt.Shard(w[r0:r1].clone(), SHAPE, (r0, 0)), "step": step}


def body(rank: int, world: int, root: str):
    import torch.distributed as dist

    m = dt.CheckpointManager(root, keep_last=2, keep_every=3)
    assert m.latest() is None
    removed = {}
    for step in range(1, 5):
        removed[step] = m.save(step, state(rank, step))["removed"]
    # A background save; retention runs when it is waited on.
    h = m.save(5, state(rank, 5), async_save=True)
    assert m.in_flight() == 5
    removed[5] = h.wait()["removed"]
    # A background save finished by the next call.
    m.save(6, state(rank, 6), async_save=True)
    try:
        m.save(6, state(rank, 6))
        refused = None
    except dckpt.AlreadyExists as e:
        refused = str(e)
    steps = [(s["step"], s["committed"]) for s in m.steps()]
    latest = m.latest()
    # The latest step loaded whole on every rank (another split than it was saved in).
    target = {"w": torch.zeros(SHAPE), "step": None}
    loaded = m.load_latest(target)
    exact = same_bits(target["w"], weight(6)) and target["step"] == 6
    # A dead save of step 4 (older than the latest): gc removes it; a newer one stays.
    if rank == 0:
        for d in ("step-000000000004", "step-000000000009"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
            with open(os.path.join(root, d, "partial"), "wb") as f:
                f.write(b"dead")
    dist.barrier()
    report = m.gc()
    after = [(s["step"], s["committed"]) for s in m.steps()]
    return removed, refused, steps, latest, loaded, exact, [(s["step"], s["reason"]) for s in report["steps"]], after


def test_manager_two_ranks(tmp_path):
    root = str(tmp_path / "run")
    results = run_ranks(body, 2, root)
    assert results[0] == results[1]
    removed, refused, steps, latest, loaded, exact, gc_steps, after = results[0]
    # keep_last 2 and every 3rd: 3 stays; 4 went after step 6 (in the refused call).
    assert removed == {1: [], 2: [], 3: [1], 4: [2], 5: []}, removed
    assert refused is not None and "already committed" in refused
    assert steps == [(3, True), (5, True), (6, True)]
    assert latest == 6 and loaded == 6 and exact
    assert gc_steps == [(4, "uncommitted")]
    assert after == [(3, True), (5, True), (6, True), (9, False)]


def test_background_saves_keep_their_own_outcomes(tmp_path):
    """Each background step's handle returns its own outcome, however many times it is
    waited on, also after the manager finished it (a next save, a listing)."""
    m = dt.CheckpointManager(str(tmp_path / "run"), keep_last=2)
    h1 = m.save(1, {"w": weight(1)}, async_save=True)
    h2 = m.save(2, {"w": weight(2)}, async_save=True)  # finishes step 1 first
    assert h1.done() and m.in_flight() == 2
    assert h1.wait()["step"] == 1 and h1.wait()["step"] == 1
    assert m.latest() == 2  # finishes step 2
    o2 = h2.wait()
    assert o2["step"] == 2 and o2["removed"] == [] and h2.wait() == o2
    h3 = m.save(3, {"w": weight(3)}, async_save=True)
    assert h3.wait()["removed"] == [1] and m.latest() == 3
    back = {"w": torch.zeros(SHAPE)}
    assert m.load_latest(back) == 3 and same_bits(back["w"], weight(3))


def test_wrong_arguments_are_refused_before_the_step_begins(tmp_path, monkeypatch):
    """An unknown keyword leaves the step unsaved (a retry saves it; a background handle is
    not lost), and is refused by a restore; zero ranks per node, given or from LOCAL_WORLD_SIZE, is a ValueError naming
    the value, not a ZeroDivisionError."""
    from conftest import caught

    m = dt.CheckpointManager(str(tmp_path / "run"))
    for async_save in (False, True):
        err = caught(m.save, 1, {"w": weight(1)}, async_save=async_save, replcia_check="all")
        assert err is not None and err[0] == "TypeError" and "replcia_check" in err[1], err
        err = caught(m.save, 1, {"w": weight(1)}, async_save=async_save, replica_check="most")
        assert err is not None and err[0] == "ValueError" and "replica_check='most'" in err[1], err
        err = caught(m.save, 1, {"w": weight(1)}, async_save=async_save, collective="mpi")
        assert err is not None and err[0] == "ValueError" and "collective='mpi'" in err[1], err
    assert m.steps() == [] and m.latest() is None and m.in_flight() is None
    assert m.save(1, {"w": weight(1)})["step"] == 1 and m.latest() == 1
    # A restore's keywords too: a local tier's restore would not have read a misspelt one.
    err = caught(m.load_latest, {"w": torch.zeros(SHAPE)}, strcit=False)
    assert err is not None and err[0] == "TypeError" and "strcit" in err[1], err

    local = str(tmp_path / "nodes" / "{node}")
    err = caught(lambda: dt.CheckpointManager(str(tmp_path / "a"), local=local, ranks_per_node=0).save(1, {"w": weight(1)}))
    assert err is not None and err[0] == "ValueError" and "ranks_per_node=0" in err[1], err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    m = dt.CheckpointManager(str(tmp_path / "b"), local=local, persistent_every=1)
    err = caught(m.save, 1, {"w": weight(1)})
    assert err is not None and err[0] == "ValueError" and "LOCAL_WORLD_SIZE='0'" in err[1], err
    assert m.steps() == []  # refused before the run root's step began
    # keep_every=0 (no step is a multiple of it) is refused, not read as "keep none".
    err = caught(dt.CheckpointManager, str(tmp_path / "c"), keep_every=0)
    assert err is not None and err[0] == "ValueError" and "keep_every=0" in err[1], err
    # keep_last too, at the start: a bad value failed every save after its step committed.
    for bad in (-1, 2.0, "3", True):
        err = caught(dt.CheckpointManager, str(tmp_path / "c"), keep_last=bad)
        assert err is not None and err[0] == "ValueError" and f"keep_last={bad!r}" in err[1], err
    assert dt.CheckpointManager(str(tmp_path / "c"), keep_last=0).keep_last == 0
    # A node-local template without {node} or {rank}: every node's "copy" would be one file.
    shared = dt.CheckpointManager(str(tmp_path / "d"), local=str(tmp_path / "shared"), ranks_per_node=1)
    err = caught(shared.save, 1, {"w": weight(1)})
    assert err is not None and err[0] == "ValueError" and "neither {node} nor {rank}" in err[1], err
    assert shared.steps() == []


def different_steps(rank: int, world: int, root: str):
    from conftest import caught

    m = dt.CheckpointManager(root)
    return caught(m.save, 10 + rank, state(rank, 10))


def test_a_memory_root_finds_its_own_steps():
    """A ``memory://NAME`` root: its steps' URLs name directories of the same store (they
    named other stores, so the run root listed none of its saves)."""
    m = dt.CheckpointManager("memory://manager-test-root", keep_last=1)
    m.save(1, {"w": weight(1)})
    assert m.latest() == 1
    assert m.save(2, {"w": weight(2)})["removed"] == [1]
    target = {"w": torch.zeros(SHAPE)}
    assert m.load_latest(target) == 2 and same_bits(target["w"], weight(2))


def test_ranks_saving_different_steps_are_refused_on_every_rank(tmp_path):
    """Every rank refuses a step the ranks do not all give, before anything is written."""
    errs = run_ranks(different_steps, 2, str(tmp_path / "run"))
    for err in errs:
        assert err is not None and "different steps, from 10 to 11" in err[1], errs
    assert not os.path.exists(tmp_path / "run") or not any(os.scandir(tmp_path / "run"))


def background_failure(rank: int, world: int, root: str):
    from conftest import caught

    m = dt.CheckpointManager(root)
    started = caught(m.save, 1, {"w": weight(1), "rank": rank}, async_save=True)
    return started, caught(m.save, 2, state(rank, 2)), m.latest()


def test_a_background_saves_error_names_its_step(tmp_path):
    """A background save's error comes with the next call, which saves another step: it
    names the step it is of, on every rank, and that call saves nothing. On the old code
    the error of step 1 read as the failure of step 2's save."""
    for started, nxt, latest in run_ranks(background_failure, 2, str(tmp_path / "run")):
        assert started is None, started
        assert nxt is not None and nxt[0] == "CoverageError", nxt
        assert nxt[1].startswith("step 1, saved in the background: ") and '"rank"' in nxt[1], nxt
        assert latest is None


def test_a_restart_names_the_newer_steps_it_passes_over(tmp_path):
    """A damaged newer step is passed over with its reason in ``fallbacks``."""
    root = str(tmp_path / "run")
    m = dt.CheckpointManager(root)
    for step in (1, 2):
        m.save(step, {"w": weight(step)})
    meta = os.path.join(root, dckpt._dckpt.RunRoot.step_dir(2), "dckpt.meta")
    with open(meta, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    back = {"w": torch.zeros(SHAPE)}
    r = dt.CheckpointManager(root).load_latest(back, info=True)
    assert r["step"] == 1 and same_bits(back["w"], weight(1)), r
    assert any(f.startswith("step 2: damaged") for f in r["fallbacks"]), r
