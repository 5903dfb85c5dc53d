"""The integration examples run as documented (few steps) and resume from their checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip(
    "transformers", reason="the examples need transformers and accelerate (pip install '.[hf]')"
)

ROOT = Path(__file__).resolve().parent.parent


def accelerate_launch(*args: str) -> str:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4",
        "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "no",
        str(ROOT / "examples" / "accelerate_lm.py"), "--ranks-per-node", "2", *args,
    ]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    process = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-6000:]
    return process.stdout


def last_log(output: str) -> tuple[str, str, str]:
    """Step, val loss and consensus distance of the last "step ..." line. Not the train loss: that is
    a mean since the previous log line, which a resumed run and a straight one put at other steps."""
    words = [line.split() for line in output.splitlines() if line.startswith("step")][-1]
    assert words[5:7] == ["val", "loss"] and words[8] == "consensus", words  # the layout read below
    return words[1], words[7], words[11]


def test_accelerate_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    first = accelerate_launch(  # a checkpoint at step 3 (--save-every), replaced at the end
        "--steps", "6", "--log-every", "3", "--block", "32", "--output-dir", str(checkpoint),
        "--save-every", "3",
    )  # fmt: skip
    assert "4 processes, topology one-peer-exp+avg32" in first  # the default, its 2 nodes of 2 gossiping
    assert float(last_log(first)[2]) > 0, first
    lines = [line for line in first.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["3", "6"]
    assert (checkpoint / "model.safetensors").is_file()
    assert len(list((checkpoint / "decentadam").glob("rank-*.pt"))) == 4
    # --resume auto: continue from --output-dir's checkpoint (what a launcher's restart runs)
    shutil.copytree(checkpoint, tmp_path / "resumed")
    resumed = accelerate_launch(
        "--steps", "8", "--log-every", "4", "--block", "32", "--resume", "auto",
        "--output-dir", str(tmp_path / "resumed"),
    )  # fmt: skip
    assert f"resumed from {tmp_path / 'resumed'} at step 6" in resumed
    assert [line.split()[1] for line in resumed.splitlines() if line.startswith("step")] == ["8"]
    # exact: the same as 8 steps without a stop (parameters, AccumAdam state, schedule, RNG, data order)
    straight = accelerate_launch(
        "--steps", "8", "--log-every", "4", "--block", "32", "--output-dir", str(tmp_path / "straight")
    )
    assert last_log(resumed) == last_log(straight) and last_log(resumed)[0] == "8"
    ours, reference = (load_file(tmp_path / run / "model.safetensors") for run in ("resumed", "straight"))
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[key], reference[key]) for key in ours)
