"""Translation recipe end to end: accelerate launch on 4 gloo processes -> checkpoints -> eval.bleu.

A tiny model on a small synthetic corpus (recipes/translation/synthetic.py), a few steps: the
point is the plumbing (both optimizers, checkpoints that from_pretrained loads, exact resume, BLEU
with its signature), not the score.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("sacrebleu", reason="eval.bleu needs pip install '.[recipes]'")
pytest.importorskip("accelerate", reason="the translation recipe needs pip install '.[recipes]'")

from benchmarks.parity import workers
from eval import bleu, contract
from recipes.common.launch import accelerate_launch, environment
from recipes.translation import synthetic

TINY = [
    "data.vocab_size=200", "model.layers=1", "model.d_model=32", "model.ffn_dim=64", "model.heads=2",
    "train.global_tokens=1024", "train.log_every=1", "train.eval_every=2", "train.save_every=2",
    "train.keep_last=2", "data.val_limit=40",
]  # fmt: skip


def launch(*args: str) -> str:
    command = [*accelerate_launch("recipes.translation.train", 4), "--preset", "demo-synthetic-en-de", *args]
    process = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment())
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-6000:]
    return process.stdout + process.stderr


def weights(checkpoint: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(checkpoint / "model.safetensors"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write(tmp_path_factory.mktemp("corpus"), train=600, val=40, test=12)


@pytest.mark.parametrize(
    "optimizer",
    [
        "decentralized",
        # slow (about 35 s on 2 cores): the same plumbing through the recipe's DDP branch, which the
        # default suite runs in one process in tests/test_host_reads.py, with DDP's exact save and
        # resume on 2 processes in tests/test_checkpoint.py. `make test-slow` (CI) runs it.
        pytest.param("allreduce", marks=pytest.mark.slow),
    ],
)
def test_train_checkpoint_resume_and_bleu(optimizer: str, corpus: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    settings = [f"data={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "--optimizer", optimizer, *TINY]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    output = launch(*settings, f"train.output_dir={straight}", "train.max_steps=4")
    assert f"4 processes x 256 tokens x 1 micro-batches per step, {optimizer}" in output
    assert sorted(p.name for p in straight.glob("step-*")) == ["step-2", "step-4"]
    assert len((straight / "metrics.jsonl").read_text().splitlines()) == 2
    assert "[train]\nglobal_tokens = 1024" in (straight / "config.toml").read_text()
    assert list((straight / "tb").rglob("events.out.tfevents.*"))

    # the 4 ranks simulated in one process (benchmarks.parity.workers) compute the same run
    simulated = tmp_path / "simulated.json"
    workers.main([
        "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--workers", "4", "--optimizer", optimizer,
        "--steps", "4", "--eval-every", "2", "--check-against", str(straight), "--out", str(simulated),
        f"data.cache_dir={tmp_path / 'cache'}", *TINY,
    ])  # fmt: skip
    result = json.loads(simulated.read_text())
    assert result["check"]["steps"] == [1, 2, 3, 4] and result["check"]["max_relative_difference"] < 1e-5
    recipe_nll = [
        json.loads(line)["valid_nll"] for line in (straight / "metrics.jsonl").read_text().splitlines()
    ]
    assert [p["valid_nll"] for p in result["curve"]] == pytest.approx(recipe_nll, rel=1e-5)

    # resume from step 2 == 4 straight steps: bit for bit with decentadam; under DDP up to the order
    # of its gradient sums (DDP regroups its buckets after the first iteration of a process). The run
    # directory is what a kill after step 4's evaluation leaves: metrics.jsonl up to step 4, checkpoints
    # up to step 2; the resume drops the metrics of the steps it redoes.
    resumed.mkdir()
    shutil.copytree(straight / "step-2", resumed / "step-2")
    for name in ("config.toml", "metrics.jsonl"):
        shutil.copy(straight / name, resumed / name)
    output = launch(*settings, f"train.output_dir={resumed}", "train.max_steps=4", "--resume")
    assert "resumed from" in output and "at step 2" in output
    ours, reference = weights(resumed / "step-4"), weights(straight / "step-4")
    assert ours.keys() == reference.keys()
    if optimizer == "decentralized":
        assert all(torch.equal(ours[k], reference[k]) for k in ours)  # type: ignore[arg-type]
    else:
        assert all(torch.allclose(ours[k], reference[k], rtol=0, atol=1e-4) for k in ours)  # type: ignore[arg-type]
    curves = [(run / "metrics.jsonl").read_text().splitlines() for run in (straight, resumed)]
    nll = [[round(json.loads(line)["valid_nll"], 4) for line in curve] for curve in curves]
    assert nll[0] == nll[1]
    # the training loss since the previous evaluation (steps 3-4 in both runs: the resume starts at 2)
    train_loss = [[json.loads(line)["train_loss"] for line in curve] for curve in curves]
    assert all(math.isfinite(v) and v > 0 for v in train_loss[0])
    assert train_loss[1][-1] == pytest.approx(train_loss[0][-1], rel=1e-4)

    checkpoint = straight / "step-4"
    model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint)  # the checkpoint is a HF model directory
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.model_type == "marian" and len(tokenizer) <= 200
    if optimizer == "allreduce":
        return  # BLEU once is enough: eval.bleu only reads the HF directory
    # eval.bleu's command line, in this process (tests/test_bleu.py runs it as a program)
    scores = contract.main(bleu.parser(), bleu._evaluate, [
        str(straight), "--average-last", "2", "--data", str(corpus), "--split", "test", "--src", "en",
        "--tgt", "de", "--max-len-b", "5",
    ])  # fmt: skip
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert scores["sentences"] == 12 and scores["checkpoints"] == [str(straight / "step-2"), str(checkpoint)]


@pytest.mark.parametrize(
    "chosen",
    [
        [],  # the nodes on aer
        # the nodes on complete with bfloat16 updates and their second moment shared: the shared A
        # (folded into the checkpoint) resumes bit for bit
        ["optim.topology=complete", "optim.exchange=bf16_updates", "optim.share_second_moment_every=1"],
    ],
    ids=["aer", "complete-shared"],
)
def test_nodes_simulated_in_one_process_equal_the_4_process_run(
    chosen: list[str], corpus: Path, tmp_path: Path
) -> None:
    """benchmarks.parity.workers with intra_node=all_reduce (what the workers table runs at n >= 8)
    against the recipe on 4 gloo processes as 2 nodes x 2, step for step."""
    import torch

    node = ["optim.intra_node=all_reduce", "optim.second_moment=group_gradient", *chosen]
    settings = [f"data={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "--optimizer", "decentralized"]
    run = tmp_path / "run"
    launch(*settings, *TINY, *node, f"train.output_dir={run}", "train.max_steps=4")
    simulated = tmp_path / "simulated.json"
    workers.main([
        "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--workers", "4", "--optimizer",
        "decentralized", "--steps", "4", "--eval-every", "2", "--check-against", str(run), "--out",
        str(simulated), f"data.cache_dir={tmp_path / 'cache'}", *TINY, *node,
    ])  # fmt: skip
    result = json.loads(simulated.read_text())
    # bfloat16 sums: gloo adds a group's values in its own order, the simulation in rank order
    tolerance = 1e-3 if chosen else 1e-5
    assert result["check"]["steps"] == [1, 2, 3, 4] and result["check"]["max_relative_difference"] < tolerance
    recipe_nll = [json.loads(line)["valid_nll"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [p["valid_nll"] for p in result["curve"]] == pytest.approx(recipe_nll, rel=tolerance)
    if not chosen:
        return
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / "step-2", resumed / "step-2")
    for name in ("config.toml", "metrics.jsonl"):
        shutil.copy(run / name, resumed / name)
    output = launch(*settings, *TINY, *node, f"train.output_dir={resumed}", "train.max_steps=4", "--resume")
    assert "at step 2" in output
    ours, reference = weights(resumed / "step-4"), weights(run / "step-4")
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)  # type: ignore[arg-type]
