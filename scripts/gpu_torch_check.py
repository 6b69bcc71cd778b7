"""GPU check of dckpt.torch: CUDA tensors saved (async, through pinned host staging) under an
NCCL default process group, then loaded back into CUDA tensors of another layout.

Needs a machine with one or more GPUs, torch with CUDA and the dckpt wheel installed (built
elsewhere: `maturin build --profile ci -o target/wheels`, then `pip install --no-deps` it).
Run it with every GPU as a rank, e.g. `torchrun --nproc-per-node 2 scripts/gpu_torch_check.py
/tmp/dckpt-gpu`; with one GPU, `torchrun --nproc-per-node 1 ...`. Prints one line per rank
and exits 1 on any mismatch, 2 without a GPU (`--cpu` runs the same steps on gloo and the
CPU, to check the script itself).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import dckpt.torch as dt


def main(loc: str, cpu: bool) -> int:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cpu:
        # A dry run of the script's logic on a machine without a GPU.
        dist.init_process_group("gloo")
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("no GPU: nothing checked (--cpu runs the same steps on the CPU)", file=sys.stderr)
            return 2
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        dev = torch.device("cuda", local)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(7)
    w = torch.randn(1024, 512, generator=g).to(torch.bfloat16)
    e = torch.randn(256, 64, generator=g)
    rows = w.shape[0] // world
    mine = w[rank * rows : (rank + 1) * rows].to(dev, copy=True)
    # A non-contiguous CUDA source (a transposed view) and a plain replicated CUDA tensor.
    state = {
        "w": dt.Shard(mine, w.shape, (rank * rows, 0)),
        "e_t": e.to(dev).t(),
        "step": 3,
    }
    h = dt.save(state, loc, async_save=True, replace=True)
    # The source may change as soon as save returns.
    mine.zero_()
    out = h.wait()
    # Loaded whole on every rank, into CUDA targets (one non-contiguous).
    back = {"w": torch.empty(w.shape, dtype=torch.bfloat16, device=dev),
            "e_t": torch.empty(e.shape[0], e.shape[1], device=dev).t(), "step": None}
    dt.load(back, loc)
    ok = (
        torch.equal(back["w"].cpu(), w)
        and torch.equal(back["e_t"].cpu(), e.t())
        and back["step"] == 3
    )
    print(f"rank {rank}/{world} on {dev}: saved {out['bytes']} bytes, loaded back {'bit-exact' if ok else 'WRONG'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    sys.exit(main(args[0] if args else "/tmp/dckpt-gpu-check", "--cpu" in sys.argv[1:]))
