"""HF Trainer integration: 4 processes under ``accelerate launch`` against 1 process, on CPU."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the Trainer integration needs transformers (pip install '.[hf]')")

WORLD = 4
ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "trainer_worker.py")


def launch(world: int, *runs: tuple[Path, str, Path]) -> list[list[dict[str, Any]]]:
    """Each ``(OUT, SCENARIO, RUN_DIR)`` of ``runs`` in turn, in one launch of ``world`` processes (one:
    plain python); by run, every rank's results."""
    arguments = []
    for out, scenario, run_dir in runs:
        out.mkdir(parents=True, exist_ok=True)
        arguments += [str(out), scenario, str(run_dir)]
    if world == 1:
        command = [sys.executable, WORKER, *arguments]
    else:
        command = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--multi_gpu", "--num_processes", str(world), "--num_machines", "1",
            "--dynamo_backend", "no", "--mixed_precision", "no",
            WORKER, *arguments,
        ]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-6000:]
    return [[torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)] for out, _, _ in runs]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("trainer")
    (results,) = launch(WORLD, (base / "out", "fresh", base / "run"))
    return base / "run", results


@pytest.fixture(scope="module")
def resumed(
    fresh: tuple[Path, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One launch of 4 processes for two resumes of the fresh run: a copy of it whose newest checkpoint
    is incomplete, then its checkpoint-3 (saved with aer) with topology ring; every rank's results."""
    run_dir, _ = fresh
    base = tmp_path_factory.mktemp("resumed")
    shutil.copytree(run_dir, base / "run")
    (base / "run" / "checkpoint-6" / "trainer_state.json").unlink()  # as if killed while saving step 6
    resume = (base / "out-resume", "resume-last", base / "run")
    ring = (base / "out-ring", f"topology:ring={run_dir / 'checkpoint-3'}", base / "ring")
    last, refused = launch(WORLD, resume, ring)
    return last, refused


@pytest.fixture(scope="module")
def single(
    fresh: tuple[Path, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One process, two trainers: the fresh run, then the 4-process run's checkpoint-3 resumed."""
    run_dir, _ = fresh
    base = tmp_path_factory.mktemp("single")
    alone = (base / "out-fresh", "fresh", base / "fresh")
    resume = (base / "out-resume", str(run_dir / "checkpoint-3"), base / "resume")
    (fresh_run,), (resumed_run,) = launch(1, alone, resume)
    return fresh_run, resumed_run


def losses(history: list[dict[str, Any]]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def comm_mb(history: list[dict[str, Any]]) -> dict[int, float]:
    return {entry["step"]: entry["decentadam/comm_mb"] for entry in history if "loss" in entry}


def flat(state: dict[str, torch.Tensor] | Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in state.parameters()])


def test_no_ddp_and_each_gradient_has_the_single_process_scale(
    fresh: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = fresh
    for result in results:
        assert result["world_size"] == WORLD
        assert result["wrapped"] == "GPT2LMHeadModel", "the model must not be wrapped in DDP"
        assert result["average_tokens"] is False
        # normalised by this rank's own label count, not by the count over all ranks times n
        assert result["num_items"] == result["local_labels"]
        torch.testing.assert_close(result["first_grad"], result["reference_grad"], rtol=0, atol=0)


def test_logged_losses_are_comparable_across_world_sizes(
    fresh: tuple[Path, list[dict[str, Any]]], single: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    _, results = fresh
    four, one = losses(results[0]["history"]), losses(single[0]["history"])
    assert results[1]["history"] == results[0]["history"] or losses(results[1]["history"]) == four
    # step 1 runs the same initial weights on batches of the same kind: the loss is about ln(vocab)
    # whatever the world size (a loss scaled by the number of processes would be ~4x larger)
    assert four[1] == pytest.approx(one[1], rel=0.1)
    assert one[1] == pytest.approx(math.log(48), rel=0.15)
    for step in four:
        assert four[step] == pytest.approx(one[step], rel=0.25)


def test_training_logs_carry_consensus_and_comm_metrics(fresh: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fresh
    entries = [e for e in results[0]["history"] if "loss" in e]
    assert [e["step"] for e in entries] == [1, 2, 3, 4, 5, 6]
    for entry in entries:
        assert 0 < entry["decentadam/consensus_distance_rel"] < 0.05
        assert entry["decentadam/comm_mb"] > 0
        assert entry["decentadam/comm_wait_ms"] >= 0


def test_evaluation_and_checkpoints_use_the_consensus_model(fresh: tuple[Path, list[dict[str, Any]]]) -> None:
    run_dir, results = fresh
    for result in results:
        assert torch.equal(result["eval_weights"], results[0]["eval_weights"]), "evaluated the average"
        assert torch.equal(result["after_eval"], result["local"]), "local weights come back"
        assert torch.equal(result["predict_weights"], results[0]["eval_weights"]), "predicted with it"
        assert torch.equal(result["after_predict"], result["local"])
    assert not torch.equal(results[0]["local"], results[1]["local"])
    from transformers import GPT2LMHeadModel

    saved = GPT2LMHeadModel.from_pretrained(str(run_dir / "checkpoint-6"))
    assert torch.equal(flat(saved), results[0]["eval_weights"])
    assert sorted(p.name for p in (run_dir / "checkpoint-6" / "decentadam").iterdir()) == [
        "meta.json",
        *[f"rank-{r:05d}.pt" for r in range(WORLD)],
    ]


def test_resume_true_skips_a_checkpoint_without_every_rank_rng_state(
    fresh: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from decentadam.integrations.trainer import _last_complete_checkpoint

    run_dir, _ = fresh
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    assert _last_complete_checkpoint(str(copy)) == str(copy / "checkpoint-6")
    (copy / "checkpoint-6" / "rng_state_1.pth").unlink()  # rank 1 had not written it yet
    assert _last_complete_checkpoint(str(copy)) == str(copy / "checkpoint-3")


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.5])
def test_backward_overlap_is_refused_with_gradient_clipping(tmp_path: Path, max_grad_norm: float) -> None:
    from transformers import TrainingArguments

    from decentadam.integrations.trainer import DecentralizedArguments, DecentralizedTrainer
    from tests.trainer_worker import Sequences, make_model

    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_grad_norm=max_grad_norm, report_to=[], max_steps=1
    )
    with pytest.raises(
        ValueError, match=r"overlap='backward'.*max_grad_norm.*overlap='step'.*max_grad_norm=0"
    ):
        DecentralizedTrainer(
            model=make_model(),
            args=args,
            train_dataset=Sequences(8, seed=1),
            decentralized=DecentralizedArguments(overlap="backward", accum_steps=1),
        )


def test_resume_skips_an_incomplete_checkpoint_and_is_bitwise_identical(
    fresh: tuple[Path, list[dict[str, Any]]],
    resumed: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    _, uninterrupted = fresh
    resumed, _ = resumed
    for rank in range(WORLD):
        expected = losses(uninterrupted[rank]["history"])
        got = losses(resumed[rank]["history"])  # steps 1-3 come from checkpoint-3's trainer state
        assert got == expected
        assert torch.equal(resumed[rank]["local"], uninterrupted[rank]["local"])
        # communication per step counts from the resume (step 3), not from step 0; the first step
        # after it also re-exchanges the loaded weights
        expected_mb, got_mb = comm_mb(uninterrupted[rank]["history"]), comm_mb(resumed[rank]["history"])
        assert got_mb[4] >= expected_mb[4] > 0
        assert got_mb[5] == expected_mb[5] and got_mb[6] == expected_mb[6]


def test_resume_on_another_world_size_warns_and_starts_from_the_average(
    single: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    _, result = single  # checkpoint-3 of the 4-process run, resumed by 1
    assert any("saved by 4 ranks and is resumed by 1" in w for w in result["warnings"])
    assert sorted(losses(result["history"])) == [1, 2, 3, 4, 5, 6]


def test_resume_with_another_topology_is_refused(
    resumed: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    _, refused = resumed  # resumed with topology ring from a checkpoint saved with aer
    for result in refused:
        assert (
            "saved with topology 'aer' and local_world_size 2, but this run uses topology 'ring'"
            in result["error"]
        )
        assert "DecentralizedArguments(topology='aer', local_world_size=2)" in result["error"]


def test_the_group_gradient_second_moment_reaches_the_optimizer(tmp_path: Path) -> None:
    from decentadam import DecentralizedAdam

    gossip = _trainer(tmp_path, intra_node="gossip", second_moment="group_gradient", v_every=3)
    optimizer = gossip.create_optimizer()
    assert (
        isinstance(optimizer, DecentralizedAdam) and optimizer.setting.second_moment.name == "group_gradient"
    )
    assert optimizer.moment_source.estimate_every == 3
    optimizer.close()


def _trainer(tmp_path: Path, **decentralized: Any) -> Any:
    """A one-process DecentralizedTrainer with these DecentralizedArguments (nothing trained)."""
    from transformers import TrainingArguments

    from decentadam.integrations.trainer import DecentralizedArguments, DecentralizedTrainer
    from tests.trainer_worker import Sequences, make_model

    return DecentralizedTrainer(
        model=make_model(),
        args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1),
        train_dataset=Sequences(8, seed=1),
        decentralized=DecentralizedArguments(**decentralized),
    )


def test_the_arguments_reach_the_optimizer(tmp_path: Path) -> None:
    from decentadam import SETTINGS, DecentralizedAdam, GroupGradient, Setting

    optimizer = _trainer(tmp_path, intra_node="all_reduce", second_moment="group_gradient").create_optimizer()
    assert isinstance(optimizer, DecentralizedAdam)
    assert optimizer.setting == Setting(intra_node="all_reduce", second_moment=GroupGradient())
    assert optimizer.moment_source.estimate_every == 1  # the node's gradients, every step
    assert optimizer.setting.share_every == 0  # not shared by default
    optimizer.close()
    default = _trainer(tmp_path).create_optimizer()
    assert isinstance(default, DecentralizedAdam) and default.setting == SETTINGS["default"]
    default.close()
    updates = _trainer(tmp_path, exchange="bf16_updates", topology="complete").create_optimizer()
    assert isinstance(updates, DecentralizedAdam) and updates.setting.exchange == "bf16_updates"
    updates.close()
    chosen = _trainer(tmp_path, setting="nodes-complete-bf16", local_world_size=1).create_optimizer()
    assert isinstance(chosen, DecentralizedAdam) and chosen.setting == SETTINGS["nodes-complete-bf16"]
    chosen.close()
    synced = _trainer(tmp_path, sync_steps=300, bucket_size_mb=1.0).create_optimizer()
    assert isinstance(synced, DecentralizedAdam) and synced.setting.sync_steps == 300
    assert synced.comm.bucket_size_mb == 1.0
    synced.close()


@pytest.mark.parametrize(
    ("decentralized", "message"),
    [
        ({"intra_node": "node"}, r"intra_node must be 'gossip' or 'all_reduce', got 'node'"),
        ({"exchange": "fp8"}, r"exchange must be 'parameters' or 'bf16_updates', got 'fp8'"),
        (
            {"intra_node": "all_reduce", "second_moment": "group_gradient", "v_every": 2},
            r"v_every=2: with intra_node='all_reduce' .* leave v_every out",
        ),
        (
            {"share_second_moment_every": 2},
            r"share_second_moment_every=2 shares .* pass intra_node='all_reduce', second_moment=",
        ),
        ({"overlap": "sometimes"}, r"overlap must be 'step' or 'backward', got 'sometimes'"),
    ],
)
def test_bad_settings_are_refused_with_the_arguments(decentralized: dict[str, Any], message: str) -> None:
    from decentadam.integrations.trainer import DecentralizedArguments

    with pytest.raises(ValueError, match=message):  # before a Trainer (or a process group) is built
        DecentralizedArguments(**decentralized)
