#!/usr/bin/env python3
"""Round trip of `dckpt convert` and `dckpt export` through the real `safetensors` package.

Needs torch and safetensors (not the dckpt Python package):

    check_export.py --dckpt target/ci/dckpt [--dir DIR]

1. torch makes a model with edge-case values (NaN, +-inf, -0, subnormals of every
   dtype, values that round to a tie, f32 past the largest half) in f32, bf16, f16, int64
   and bool, and `safetensors.torch.save_file` writes it;
2. `dckpt convert` turns it into a dckpt checkpoint;
3. `dckpt export --format safetensors` writes it back, once as it is (one file) and once
   with each `--dtype` (bf16, fp16, fp32) and a small `--max-shard-size` (shards + index);
4. `safetensors.torch.load_file` reads every output file, and every tensor must equal,
   bit for bit, the original (or `original.to(dtype)` for floats when cast; NaN payloads
   aside, see `same_bits`), with every key exactly once across the shards, as the index says.

Exits 0 when everything matches and prints one JSON line of what was checked; exits 1
naming the first tensor that differs. A temporary directory is used unless --dir is given.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def model():
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor(
        [1.0, -2.5, float("nan"), float("inf"), float("-inf"), -0.0, 1e-45, 1e-40, 65504.0, 65520.0,
         2.0**-24, 2.0**-25, 3 * 2.0**-25, 1.00390625, 1 + 2**-8 + 2**-9, 1e-6, 3.0e38],
        dtype=torch.float32,
    )
    return {
        "model.embed.weight": torch.randn(300, 64, generator=g),
        "model.layers.0.fc.weight": (torch.randn(128, 96, generator=g) * 1e4).to(torch.bfloat16),
        "model.layers.0.fc.bias": torch.randn(128, generator=g).to(torch.float16),
        "model.specials": specials,
        "model.specials_bf16": specials.to(torch.bfloat16),
        "model.specials_f16": specials.to(torch.float16),
        "model.tiny": torch.randn(1, 1, 3, generator=g),
        "step": torch.tensor(1234, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def same_bits(a, b):
    """Bit-exact, except that a NaN equals any NaN: PyTorch itself writes different NaN bits
    for the same cast depending on the path its kernel takes (vectorized body or scalar
    tail), so only where NaNs are is checked there."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    if a.is_floating_point():
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a[~nan], b[~nan]
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def want_of(t, dtype):
    return t.to(CASTS[dtype]) if dtype and t.is_floating_point() else t


def strict_bits(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    return a.numel() == 0 or bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def load_output(out):
    """Every tensor of an export, checked against its index when there is one."""
    index = os.path.join(out, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(out, "model.safetensors")), 1
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    tensors, files = {}, sorted(set(weight_map.values()))
    for name in files:
        for k, v in load_file(os.path.join(out, name)).items():
            if k in tensors:
                sys.exit(f"{k}: in two files")
            if weight_map.get(k) != name:
                sys.exit(f"{k}: in {name}, the index says {weight_map.get(k)}")
            tensors[k] = v
    if set(tensors) != set(weight_map):
        sys.exit(f"index and files disagree: {sorted(set(weight_map) ^ set(tensors))}")
    return tensors, len(files)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dckpt", required=True, help="the dckpt binary")
    p.add_argument("--dir", help="work directory, kept (default: a temporary one, removed unless the check fails)")
    a = p.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="dckpt-export-check-")
    check(a.dckpt, work)
    if not a.dir:
        shutil.rmtree(work)


def check(dckpt: str, work: str):
    """Converts, exports in each dtype, and compares with torch's casts; prints the result
    or exits naming the first file that differs (its work directory kept)."""
    src = model()
    hf = os.path.join(work, "hf.safetensors")
    save_file(src, hf, metadata={"format": "pt"})
    ckpt = os.path.join(work, "ckpt")
    subprocess.run([dckpt, "convert", hf, ckpt, "--json"], check=True, stdout=subprocess.DEVNULL)
    checked = []
    for dtype in [None, *CASTS]:
        out = os.path.join(work, f"out-{dtype or 'same'}")
        cmd = [dckpt, "export", ckpt, out, "--format", "safetensors", "--json"]
        if dtype:
            cmd += ["--dtype", dtype, "--max-shard-size", "20KB", "--buffer-size", "4KiB"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        got, files = load_output(out)
        if set(got) != set(src):
            sys.exit(f"{out}: keys differ: {sorted(set(got) ^ set(src))}")
        for k, t in src.items():
            want = want_of(t, dtype)
            if not same_bits(got[k], want):
                sys.exit(f"{out}: tensor {k} ({got[k].dtype}) differs from torch's ({want.dtype})")
        # Tensors equal only up to NaN bits (reported, not a failure).
        nan_bits = sorted(k for k, t in src.items() if not strict_bits(got[k], want_of(t, dtype)))
        checked.append({"dtype": dtype or "unchanged", "files": files, "tensors": len(got), "nan_bits_differ": nan_bits})
    print(json.dumps({"ok": True, "torch": torch.__version__, "checked": checked}))


if __name__ == "__main__":
    main()
