"""What a step saved through dckpt.torch.CheckpointManager records, as `dckpt ls` reads it
(its step and when its save began), and the rank its errors carry on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

import dckpt
import dckpt.torch as dt
from conftest import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DCKPT = os.environ.get("DCKPT_BIN") or os.path.join(ROOT, "target", "ci", "dckpt")


def test_a_python_step_records_its_step_and_start(tmp_path):
    # Python-saved steps once listed `saved_at_unix: null`: they recorded no start.
    root = str(tmp_path / "run")
    before = int(time.time())
    m = dt.CheckpointManager(root, keep_last=2)
    m.save(7, {"w": torch.arange(6, dtype=torch.float32)})
    after = int(time.time())
    [step] = m.steps()
    assert step["step"] == 7 and step["committed"], step
    assert before <= step["saved_at_unix"] <= after, step
    assert step["layout"]["step"] == "7" and step["layout"]["world_size"] == "1", step


@pytest.mark.skipif(not os.access(DCKPT, os.X_OK), reason=f"no dckpt binary at {DCKPT} (set DCKPT_BIN)")
def test_ls_json_shows_when_a_python_step_was_saved(tmp_path):
    root = str(tmp_path / "run")
    m = dt.CheckpointManager(root)
    m.save(3, {"w": torch.ones(4)})
    p = subprocess.run([DCKPT, "ls", root, "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    listed = json.loads(p.stdout)
    [step] = listed["steps"]
    assert step["step"] == 3 and step["committed"] and step["latest"], step
    assert isinstance(step["saved_at_unix"], int) and step["saved_at_unix"] > 0, step


def refuse_twice(rank: int, world: int, root: str):
    m = dt.CheckpointManager(root)
    m.save(1, {"w": torch.ones(4)})
    try:
        m.save(1, {"w": torch.ones(4)})
    except dckpt.AlreadyExists as e:
        return type(e).__name__, e.rank
    return None


def test_a_refused_step_names_rank_0_on_every_rank(tmp_path):
    # The refusal is decided on rank 0; its error once lost `rank` on the other ranks.
    results = run_ranks(refuse_twice, 2, str(tmp_path / "run"))
    assert results == [("AlreadyExists", 0), ("AlreadyExists", 0)], results
