"""dckpt.torch.CheckpointManager with a node-local tier on 4 gloo ranks, 2 per simulated
node: steps saved locally every step (synchronously and in the background) and to the run
root every 3; a resume with every own copy restores the newest local step; after a node's
directory is deleted, its ranks' parts come from their peers; with a peer copy damaged
too, that part comes from the run root's step of the same number, or, when the run root
has no such step, the whole restore is the run root's latest. Bit-exact every time."""

from __future__ import annotations

import os
import shutil

import torch

import dckpt.torch as dt
from conftest import gen, run_ranks, same_bits

ROWS, COLS = 8, 6


def weight(step: int) -> torch.Tensor:
    return gen((ROWS, COLS), torch.float32, 500 + step)


def state(rank: int, step: int) -> dict:
    w = weight(step)
    r0, r1 = 2 * rank, 2 * rank + 2
    return {"w": dt.Shard(w[r0:r1].clone(), (ROWS, COLS), (r0, 0)), "bias": gen((3,), torch.float32, step), "step": step}


def empty(rank: int) -> dict:
    r0 = 2 * rank
    return {"w": dt.Shard(torch.zeros(2, COLS), (ROWS, COLS), (r0, 0)), "bias": torch.zeros(3), "step": None}


def manager(root: str, keep: int = 1) -> dt.CheckpointManager:
    return dt.CheckpointManager(
        f"{root}/run",
        local=f"{root}/nodes/{{node}}",
        ranks_per_node=2,
        local_every=1,
        persistent_every=3,
        local_keep=keep,
    )


def restored(rank: int, root: str, keep: int = 1) -> dict:
    m = manager(root, keep)
    sd = empty(rank)
    info = m.load_latest(sd, info=True)
    step = info["step"]
    want = state(rank, step)
    ok = same_bits(sd["w"].data, want["w"].data) and same_bits(sd["bias"], want["bias"]) and sd["step"] == step
    return {"step": step, "sources": info["sources"], "fallbacks": info["fallbacks"], "bit_exact": ok}


def restore_body(rank: int, world: int, root: str, keep: int = 1) -> dict:
    return restored(rank, root, keep)


def save_steps(rank: int, world: int, root: str, steps: list[int], keep: int = 1):
    m = manager(root, keep)
    outs = []
    for step in steps:
        if step % 2:
            outs.append(m.save(step, state(rank, step)))
        else:
            outs.append(m.save(step, state(rank, step), async_save=True).wait())
    return [(o["step"], "local" in o, "save_id" in o) for o in outs]


def lose_node(root: str, node: int) -> None:
    shutil.rmtree(f"{root}/nodes/{node}")


def flip(root: str, node: int, step: int, part: int) -> None:
    path = f"{root}/nodes/{node}/step-{step:012d}/part-{part}.data"
    with open(path, "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0x40]))


def test_local_tier_on_four_gloo_ranks(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(save_steps, 4, root, [1, 2, 3, 4])
    assert saved[0] == [(1, True, False), (2, True, False), (3, True, True), (4, True, False)], saved[0]
    # Only the newest local step is kept (local_keep=1; the directories of removed steps
    # are left empty); the run root holds step 3.
    kept = sorted(d for d in os.listdir(f"{root}/nodes/0") if os.listdir(f"{root}/nodes/0/{d}"))
    assert kept == ["step-000000000004"], kept

    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["sources"], r["bit_exact"]) == (4, {"own": 4, "peer": 0, "persistent": 0}, True), r

    lose_node(root, 1)
    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["sources"], r["bit_exact"]) == (4, {"own": 2, "peer": 2, "persistent": 0}, True), r

    # Step 4 again on the local tier only, and node 1 lost with rank 2's only other copy
    # (on node 0) damaged: step 4 is not whole and the run root has no step 4.
    run_ranks(save_steps, 4, root, [5, 6])  # 6: both tiers
    lose_node(root, 1)
    flip(root, 0, 6, 2)
    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["sources"], r["bit_exact"]) == (6, {"own": 2, "peer": 1, "persistent": 1}, True), r
        assert any("run root's step 6" in f for f in r["fallbacks"]), r

    run_ranks(save_steps, 4, root, [7])  # local only
    lose_node(root, 1)
    flip(root, 0, 7, 2)
    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["sources"], r["bit_exact"]) == (6, {"own": 0, "peer": 0, "persistent": 4}, True), r
        assert any("run root has no step 7" in f for f in r["fallbacks"]), r

    # Two local steps kept: where the newer is not whole and not in the run root, the older
    # local one restores (the run root's older step 6 lost step 7's progress, and step 7).
    run_ranks(save_steps, 4, root, [7, 8], 2)  # local only
    lose_node(root, 1)
    flip(root, 0, 8, 2)
    for r in run_ranks(restore_body, 4, root, 2):
        assert (r["step"], r["sources"], r["bit_exact"]) == (7, {"own": 2, "peer": 2, "persistent": 0}, True), r
        assert any("run root has no step 8" in f for f in r["fallbacks"]), r


def gc_body(rank: int, world: int, root: str):
    return manager(root, keep=1).gc().get("local_steps")


def test_gc_removes_the_local_steps_local_keep_does_not_keep(tmp_path):
    # Python's gc left the local tier alone, where the Rust manager's cleans it.
    root = str(tmp_path)
    run_ranks(save_steps, 4, root, [1, 2], 2)  # local only, both kept
    full = lambda: sorted(d for d in os.listdir(f"{root}/nodes/0") if os.listdir(f"{root}/nodes/0/{d}"))  # noqa: E731
    assert full() == ["step-000000000001", "step-000000000002"]
    assert run_ranks(gc_body, 4, root) == [[1]] * 4
    assert full() == ["step-000000000002"]
    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["bit_exact"]) == (2, True), r


def refused_restore(rank: int, world: int, root: str):
    try:
        restored(rank, root)
    except RuntimeError as e:
        return str(e)
    return None


def test_local_steps_that_are_the_runs_only_checkpoints_are_kept(tmp_path):
    """The run root holds no step and a launch cannot restore the local one (node 1, with
    rank 2's own copy, is away, and so is rank 2's other copy): every rank raises, naming the
    step, rather than unmarking it and starting afresh; with the node back, it restores."""
    root = str(tmp_path)
    run_ranks(save_steps, 4, root, [1, 2])  # local only (persistent_every=3)
    os.rename(f"{root}/nodes/1", f"{root}/node1-away")
    step = f"{root}/nodes/0/step-{2:012d}"
    parts = [p for p in os.listdir(step) if p.startswith("part-2.")]
    for p in parts:
        os.rename(f"{step}/{p}", f"{root}/{p}")
    for e in run_ranks(refused_restore, 4, root):
        assert e is not None and "local steps [2] of this run" in e and "run root holds no step" in e, e
    os.rename(f"{root}/node1-away", f"{root}/nodes/1")
    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["bit_exact"]) == (2, True), r


def misplaced_node(rank: int, world: int, root: str):
    """Rank 3 told by torchrun it runs on node 0: every rank's save and restore raise."""
    from conftest import caught

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["GROUP_RANK"] = "0" if rank == 3 else str(rank // 2)
    m = dt.CheckpointManager(f"{root}/run", local=f"{root}/nodes/{{node}}", local_every=1, persistent_every=1)
    plain = dt.CheckpointManager(f"{root}/plain")
    # Over TCP, a checkpointer is made by every rank together: rank 1 refusing first must
    # not leave the others waiting to make it.
    replaced = caught(plain.save, 1, state(rank, 1), replace=rank == 1, collective="tcp")
    negative = caught(plain.save, -1 if rank == 2 else 1, state(rank, 1))
    # A node-local directory on some nodes only (from each node's environment, say).
    odd = dt.CheckpointManager(f"{root}/odd", local=None if rank == 3 else f"{root}/odd/{{node}}", ranks_per_node=2)
    differ = caught(odd.save, 1, state(rank, 1))
    return caught(m.save, 1, state(rank, 1)), caught(m.load_latest, empty(rank)), replaced, negative, differ


def test_a_rank_that_refuses_a_step_fails_every_rank(tmp_path):
    """A wrong ``GROUP_RANK`` differs by node, so only that node's ranks see it, and an
    argument can differ by rank (``replace`` on one): those ranks raise their own error and
    every other rank one naming them, at once, with nothing written; a step out of range on
    one rank too; and managers made otherwise on one rank (no local tier there). On the old
    code the other ranks went on into the save and waited for the collective's timeout (over
    TCP, for every rank to connect)."""
    root = str(tmp_path)
    for rank, (save, load, replaced, negative, differ) in enumerate(run_ranks(misplaced_node, 4, root)):
        for err in (save, load):
            assert err is not None, rank
            if rank == 3:
                assert err[0] == "ValueError" and "rank 3 is on node 0 (GROUP_RANK), not 1" in err[1], err
            else:
                assert err[0] == "RequestError" and "rank 3 refused to go on" in err[1], err
        assert replaced is not None, rank
        if rank == 1:
            assert replaced[0] == "ValueError" and "replace is refused" in replaced[1], replaced
        else:
            assert replaced[0] == "RequestError" and "rank 1 refused to go on" in replaced[1], replaced
        if rank == 2:
            assert negative[0] == "ValueError" and "step -1: expected a whole number" in negative[1], negative
        else:
            assert negative[0] == "RequestError" and "rank 2 refused to go on" in negative[1], negative
        assert differ is not None and "the ranks' managers differ" in differ[1], differ
    assert not os.path.exists(f"{root}/nodes") and not os.path.exists(f"{root}/run/step-{1:012d}")
    assert not os.path.exists(f"{root}/plain/step-{1:012d}")


def wrong_local_option(rank: int, world: int, root: str):
    """Rank 1 gives the native save and restore an option of the local tier wrongly."""
    from conftest import caught
    from dckpt.torch._process import _checkpointer

    ckpt, _ = _checkpointer(None, None)
    local = {"dir": f"{root}/nodes/{rank}", "step": 1, "ranks_per_node": 1, "copies": 1}
    if rank == 1:
        local["if_whole"] = "bogus"
    saved = caught(ckpt.save, None, [], [], local=local)
    restored = caught(ckpt.load, f"{root}/nodes/{rank}", [], [], local={"min_step": "one" if rank == 1 else None})
    return saved, restored


def test_a_local_option_given_wrongly_on_one_rank_fails_every_rank(tmp_path):
    """The rank's error is its part failing: every rank's save and restore fail at once,
    naming rank 1 and the option. On the old code rank 1 raised before the first round, and
    the others waited in it until the collective's timeout."""
    for rank, (saved, restored) in enumerate(run_ranks(wrong_local_option, 2, str(tmp_path))):
        assert saved is not None and "rank 1" in saved[1] and '"bogus"' in saved[1], (rank, saved)
        assert restored is not None and "rank 1" in restored[1] and "min_step" in restored[1], (rank, restored)
    assert not os.path.exists(f"{tmp_path}/nodes/0/step-{1:012d}"), "rank 0 wrote nothing of the step"


def save_again(rank: int, world: int, root: str):
    import torch.distributed as dist
    from conftest import caught

    m = manager(root)
    m.load_latest(empty(rank))  # resumes from step 2, which stays marked
    refused = caught(m.save, 2, state(rank, 99))
    m.save(3, state(rank, 3))  # both tiers
    dist.barrier()
    if rank == 0:  # as if its save to the run root had failed after the local tier's
        shutil.rmtree(f"{root}/run/step-{3:012d}")
    dist.barrier()
    retried = m.save(3, state(rank, 3))
    return refused, retried["local"]["kept"], "save_id" in retried, m.latest()


def test_a_whole_local_step_is_not_saved_again(tmp_path):
    """A step the local tier holds whole is refused as a committed one is, on every rank,
    and still restores: saved again, it was unmarked first, so a save that failed midway
    lost the run's newest (here its only) step. One the run root is due at too is its save
    there retried: the local copy is kept and the run root commits it."""
    root = str(tmp_path)
    run_ranks(save_steps, 4, root, [1, 2])  # local only (persistent_every=3)
    for refused, kept, committed, latest in run_ranks(save_again, 4, root):
        assert refused is not None and refused[0] == "AlreadyExists", refused
        assert "step-000000000002/done-0" in refused[1], refused
        assert (kept, committed, latest) == (True, True, 3)
    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["bit_exact"], r["sources"]["own"]) == (3, True, 4), r


def failing_disk(rank: int, world: int, root: str):
    m = manager(root)
    sync = m.save(3, state(rank, 3))
    background = m.save(6, state(rank, 6), async_save=True).wait()
    return [(o["step"], "local" in o, "save_id" in o, o.get("local_error", "")) for o in (sync, background)]


def test_a_failing_local_disk_does_not_stop_the_run_roots_save(tmp_path):
    # A full or failing node-local disk (here a file where node 1's step directory goes)
    # failed the run root's save of the same step too: the local tier only caches it.
    root = str(tmp_path)
    os.makedirs(f"{root}/nodes/1")
    for step in (3, 6):
        with open(f"{root}/nodes/1/step-{step:012d}", "w") as f:
            f.write("not a directory")
    for outs in run_ranks(failing_disk, 4, root):
        for step, (got, local, persistent, why) in zip((3, 6), outs):
            assert (got, local, persistent) == (step, False, True), outs
            assert "rank 2" in why or "rank 3" in why, outs
    for r in run_ranks(restore_body, 4, root):
        assert (r["step"], r["bit_exact"]) == (6, True), r
