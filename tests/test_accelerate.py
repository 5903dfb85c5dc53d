"""Accelerate integration, under a real ``accelerate launch`` of 4 CPU processes (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="the Accelerate integration needs accelerate (pip install '.[hf]')")

from tests.accelerate_worker import ACCUM, MAX_NORM

WORLD = 4
ROOT = Path(__file__).resolve().parent.parent


def launch(out: Path, scenarios: str, *extra: str) -> list[dict[str, Any]]:
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1",
        "--dynamo_backend", "no", *extra,
        str(ROOT / "tests" / "accelerate_worker.py"), str(out), scenarios,
    ]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch for every scenario without mixed precision (each launch costs 4 imports of torch
    and accelerate); each scenario builds its own Accelerator, model and optimizer."""
    scenarios = "loop,fp16,fp16_resume,backward,a2cid2"
    return launch(tmp_path_factory.mktemp("accelerate"), scenarios, "--mixed_precision", "no")


def test_no_ddp_and_each_rank_keeps_its_own_gradient(runs: list[dict[str, Any]]) -> None:
    loop = [r["loop"] for r in runs]
    assert loop[0]["num_processes"] == WORLD
    for rank in range(WORLD):
        assert not loop[rank]["wrapped_by_ddp"], loop[rank]["model_type"]
        # the gradient at the first optimizer step is exactly the single-process gradient of this
        # rank's own two micro-batches: nothing averaged it with other ranks
        torch.testing.assert_close(loop[rank]["first_grad"], loop[rank]["reference_grad"], rtol=0, atol=0)
        for other in range(rank):
            assert not torch.allclose(loop[rank]["first_grad"], loop[other]["first_grad"])


def test_the_only_collectives_are_the_gossip_exchanges(runs: list[dict[str, Any]]) -> None:
    for result in (r["loop"] for r in runs):
        # 3 optimizer steps (6 micro-batches) profiled: one exchange per bucket and step, no other
        # collective. AER on 2 nodes x 2 alternates a node's all_reduce with the two-node group's
        # hierarchical sum, whose reduce-scatter the step issues as one send and one receive (the
        # rest runs on the exchange's driver thread, which this profiler does not record).
        assert result["profiled_exchanges"] == 3 * result["buckets"]
        counts = result["collectives"]
        assert set(counts) <= {"gloo:all_reduce", "gloo:send", "gloo:recv"}, counts
        hierarchical = counts.get("gloo:send", 0)
        assert hierarchical >= 1 and counts.get("gloo:recv", 0) == hierarchical, counts
        assert counts.get("gloo:all_reduce", 0) + hierarchical == result["profiled_exchanges"], counts


def test_accumulate_exchanges_once_per_optimizer_step(runs: list[dict[str, Any]]) -> None:
    for result in (r["loop"] for r in runs):
        counts = result["exchanges_after_micro_batch"]
        assert len(counts) == 8 * ACCUM
        steps = result["step_count"]
        assert steps == 8
        per_step = result["buckets"]
        # no exchange after a micro-batch that only accumulates; one per bucket after each step
        assert counts == [per_step * ((i + 1) // ACCUM) for i in range(len(counts))]


def test_clip_grad_norm_is_per_rank(runs: list[dict[str, Any]]) -> None:
    norms = [r["loop"]["norms"] for r in runs]
    assert len({n[0] for n in norms}) == WORLD, "each rank reports the norm of its own gradient"
    for result in (r["loop"] for r in runs):
        for before, after in zip(result["norms"], result["clipped_norms"], strict=True):
            assert after == pytest.approx(min(before, MAX_NORM), rel=1e-5)


def test_prepared_scheduler_steps_like_under_ddp(runs: list[dict[str, Any]]) -> None:
    # Accelerate steps a prepared scheduler num_processes times per optimizer step (its batch
    # semantics), the same on every rank as under DDP
    for result in (r["loop"] for r in runs):
        assert result["lr"] == pytest.approx(1e-2 / (1 + WORLD * result["step_count"]))


def test_metrics_are_logged_every_n_steps(runs: list[dict[str, Any]]) -> None:
    keys = sorted(
        [
            "decentadam/comm_mb",
            "decentadam/comm_wait_ms",
            "decentadam/consensus_distance",
            "decentadam/consensus_distance_rel",
        ]
    )
    assert runs[0]["loop"]["logged"] == [(keys, 4), (keys, 8)]


def test_fp16_skip_is_agreed_by_every_rank(runs: list[dict[str, Any]]) -> None:
    fp16 = [r["fp16"] for r in runs]
    for result in fp16:
        assert result["scaler_type"] == "SyncedGradScaler"
        # only rank 1 saw inf at step index 2, yet every rank skipped it and halved its scale
        assert result["skipped"] == [False, False, True, False, False]
        assert result["steps"] == [1, 2, 2, 3, 4]
        assert result["scales"] == [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9]
        assert result["lrs"] == fp16[0]["lrs"]
        assert result["finite"]


def test_fp16_resume_restores_the_loss_scale(runs: list[dict[str, Any]]) -> None:
    for result in (r["fp16_resume"] for r in runs):
        # the first step overflows at the initial scale and is skipped; later steps are not
        assert [skipped for skipped, _ in result["trace"]] == [True, False, False, False, False]
        # the resumed run continues at the saved scale (2**15), instead of skipping again at 2**16
        assert result["resumed_trace"] == result["trace"][2:]
        assert result["resumed_step_count"] == result["step_count"] == 4
        assert torch.equal(result["resumed_weights"], result["weights"])


def test_backward_overlap_is_refused_with_an_fp16_loss_scaler(runs: list[dict[str, Any]]) -> None:
    message = runs[0]["backward"]["fp16"]
    assert "before the fp16 loss scaler can unscale" in message and "Use overlap='step'" in message


def test_bf16_autocast(tmp_path: Path) -> None:
    results = launch(tmp_path, "bf16", "--mixed_precision", "bf16")
    for result in (r["bf16"] for r in results):
        assert result["inner_dtypes"] == ["torch.bfloat16"]
        assert result["output_dtype"] == "torch.float32"  # Accelerate converts outputs back
        assert result["param_dtypes"] == ["torch.float32"]
        assert result["step_count"] == 3
        assert all(torch.isfinite(torch.tensor(result["losses"])))


def test_a2cid2_trains_without_ddp_and_checkpoints_each_rank(runs: list[dict[str, Any]]) -> None:
    a2cid2 = [r["a2cid2"] for r in runs]
    for result in a2cid2:
        assert not result["wrapped_by_ddp"]
        assert result["scaler_type"] == "GradScaler"  # skips stay local: nothing runs in lockstep
        assert result["step_count"] == 6
        assert result["lr"] == pytest.approx(1e-2 / (1 + WORLD * 6))  # Accelerate steps it per process
        meta = result["meta"]
        assert (meta["topology"], meta["world_size"], meta["local_world_size"]) == (
            "a2cid2-ring",
            WORLD,
            None,
        )
        # each rank saves and takes back its own x and x~ - x; rank 0 writes their average
        torch.testing.assert_close(result["saved_weights"], result["own_weights"], rtol=0, atol=0)
        torch.testing.assert_close(result["reloaded_weights"], result["saved_weights"], rtol=0, atol=0)
        for saved, reloaded in zip(result["saved_offsets"], result["reloaded_offsets"], strict=True):
            torch.testing.assert_close(reloaded, saved, rtol=0, atol=0)
        assert result["reloaded_step_count"] == 6
        torch.testing.assert_close(result["final_weights"], a2cid2[0]["final_weights"], rtol=0, atol=0)
    mean = torch.stack([r["saved_weights"] for r in a2cid2]).mean(dim=0)
    torch.testing.assert_close(a2cid2[0]["consensus_weights"], mean, rtol=1e-6, atol=1e-7)
    logged = a2cid2[0]["logged"]  # accelerator.log writes on the main process only
    assert [step for _, step in logged] == [3, 6]
    assert "decentadam/consensus_distance_rel" in logged[0][0]
