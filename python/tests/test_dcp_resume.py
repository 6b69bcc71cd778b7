"""A torchtitan-shaped resume through DCP and dckpt's writer and reader: an FSDP2
(`fully_shard`) model and its Adam on gloo ranks, `get_state_dict`, `dcp.save` (sync) and
`dcp.async_save` (on a gloo group of its own, as torchtitan's async mode) of
`{"model", "optim", "train_state"}` into torchtitan's `step-N` directories; every process
killed mid-run with a save in flight; the run resumed from the newest committed step with
`dcp.load` and `set_state_dict`; the losses after the resume equal the uninterrupted run's,
bit for bit. Then 4 ranks' checkpoint loaded by 2: every parameter and optimizer state
bit-exact."""

from __future__ import annotations

import json
import os
import signal

import torch

from conftest import run_ranks, same_bits

STEPS, EVERY, KILL_AT = 8, 2, 7


def build(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def train_step(model, optim, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def state_of(model, optim, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, optim)
    return {"model": m, "optim": o, "train_state": {"step": step}}


def latest(root: str) -> int | None:
    """The newest committed `step-N` (dckpt commits its metadata last)."""
    from dckpt.dcp import DckptStorageReader

    done = [int(d[5:]) for d in os.listdir(root) if d.startswith("step-")] if os.path.isdir(root) else []
    done = [s for s in done if DckptStorageReader.validate_checkpoint_id(os.path.join(root, f"step-{s}"))]
    return max(done, default=None)


def run(rank: int, world: int, root: str, kill_at: int | None, out: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from dckpt.dcp import DckptStorageReader, DckptStorageWriter

    model, optim = build(world)
    ckpt_pg = dist.new_group(backend="gloo")  # torchtitan's group for async saves
    start = latest(root) or 0
    if start:
        state = state_of(model, optim, 0)
        dcp.load(state, storage_reader=DckptStorageReader(os.path.join(root, f"step-{start}")))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert state["train_state"]["step"] == start
    losses, pending = {}, None
    for step in range(start + 1, STEPS + 1):
        if step == kill_at:
            with open(f"{out}.{rank}", "w") as f:
                json.dump(losses, f)
            dist.barrier()  # both reports written before either process dies
            os.kill(os.getpid(), signal.SIGKILL)  # with the async save of the step before in flight
        losses[step] = train_step(model, optim, step, rank)
        if step % EVERY == 0:
            if pending is not None:
                pending.result()
            writer = DckptStorageWriter(os.path.join(root, f"step-{step}"), process_group=ckpt_pg)
            if (step // EVERY) % 2 == 0:
                dcp.save(state_of(model, optim, step), storage_writer=writer, process_group=ckpt_pg)
                pending = None
            else:
                pending = dcp.async_save(state_of(model, optim, step), storage_writer=writer, process_group=ckpt_pg)
    if pending is not None:
        pending.result()
    return {"start": start, "losses": losses}


def test_killed_run_resumes_bit_exact(tmp_path):
    import torch.multiprocessing as mp

    from conftest import start_ranks

    whole = run_ranks(run, 2, str(tmp_path / "whole"), None, str(tmp_path / "unused"))
    assert all(r["start"] == 0 and sorted(r["losses"]) == list(range(1, STEPS + 1)) for r in whole)

    # Killed at KILL_AT, every rank: the processes die, nothing is reported.
    root, partial = str(tmp_path / "run"), str(tmp_path / "partial")
    ctx = start_ranks(run, 2, str(tmp_path), (root, KILL_AT, partial), join=False)
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException:
        pass
    else:
        raise AssertionError("the run was not killed")
    committed = latest(root)
    assert committed is not None and committed >= KILL_AT - 1 - EVERY, committed

    resumed = run_ranks(run, 2, root, None, partial)
    for rank, r in enumerate(resumed):
        assert r["start"] == committed, (rank, r["start"])
        with open(f"{partial}.{rank}") as f:
            before = {int(k): v for k, v in json.load(f).items()}
        assert sorted(before) == list(range(1, KILL_AT)), sorted(before)
        after = {int(k): v for k, v in r["losses"].items()}
        assert sorted(after) == list(range(committed + 1, STEPS + 1))
        want = {int(k): v for k, v in whole[rank]["losses"].items()}
        # Bit for bit: float(loss) is the float32 value exactly.
        assert {s: before[s] for s in before} == {s: want[s] for s in before}, rank
        assert after == {s: want[s] for s in after}, (rank, after, want)


def full_state(model, optim) -> dict:
    """Every parameter and optimizer state as whole tensors."""
    out = {f"p.{n}": p.full_tensor().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in optim.state[p].items():
            out[f"o.{n}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def save_four(rank: int, world: int, root: str):
    import torch.distributed.checkpoint as dcp

    from dckpt.dcp import DckptStorageWriter

    model, optim = build(world)
    for step in range(1, 4):
        train_step(model, optim, step, rank)
    dcp.save(state_of(model, optim, 3), storage_writer=DckptStorageWriter(os.path.join(root, "step-3")))
    whole = full_state(model, optim)  # collective: every rank gathers
    return whole if rank == 0 else None


def load_two(rank: int, world: int, root: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from dckpt.dcp import DckptStorageReader

    model, optim = build(world)
    state = state_of(model, optim, 0)
    dcp.load(state, storage_reader=DckptStorageReader(os.path.join(root, "step-3")))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, optim)
    loss = train_step(model, optim, 4, rank)
    return {"state": got, "step": state["train_state"]["step"], "loss": loss}


def test_four_ranks_saved_two_loaded(tmp_path):
    saved = run_ranks(save_four, 4, str(tmp_path))[0]
    for rank, r in enumerate(run_ranks(load_two, 2, str(tmp_path))):
        assert r["step"] == 3
        assert sorted(r["state"]) == sorted(saved), rank
        for k, v in saved.items():
            assert same_bits(r["state"][k], v), (rank, k)
        assert r["loss"] == r["loss"] and r["loss"] > 0  # it trains on
