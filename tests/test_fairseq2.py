"""fairseq2 adapter: tiny fairseq2 recipe runs (tests/fairseq2_recipe.py), 2 CPU processes under torchrun.

Runs in the fairseq2 environment only (``scripts/make-fairseq2-env``; ``.ci/run`` does it)::

    .venv-fairseq2/bin/pytest tests/test_fairseq2.py

Run A trains 8 steps from scratch, checkpointing at steps 4 (saved asynchronously) and 8. Run C
resumes from A's step-4 checkpoint; runs B1/B2 train 4 steps (saved at the end, blocking) and resume
to 8. Each rank's weights and optimizer state at step 8 must match A's bitwise. Runs that crash inside
the adapter's save hook, after fairseq2 committed the checkpoint, must leave a directory that the
next run discards, and that next run must end as A did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest

pytest.importorskip(
    "fairseq2",
    reason="the fairseq2 adapter is tested in its own environment (fairseq2 pins torch==2.9.1): "
    "scripts/make-fairseq2-env, then .venv-fairseq2/bin/pytest tests/test_fairseq2.py",
)

import torch
from fairseq2.gang import create_fake_gangs
from fairseq2.recipe.config import (
    MixedPrecisionConfig,
    ModelSection,
    TrainerSection,
)

from decentadam import SETTINGS
from decentadam import checkpoint_files as files
from decentadam.integrations.fairseq2 import DecentralizedAdamConfig, DecentralizedFacade, _check_supported

pytestmark = pytest.mark.timeout(900)  # the module's runs: 4 torchrun launches of 2 processes, 4 more

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "tests" / "fairseq2_recipe.py")
WORLD = 2

CONFIG = """\
model:
  family: llama
  config_overrides: {model_dim: 32, num_layers: 2, num_attn_heads: 2, num_key_value_heads: 2,
                     ffn_inner_dim: 64, ffn_inner_dim_multiple_of: 1, vocab_size: 64, max_seq_len: 32}
data: {vocab_size: 64, batch_size: 4, seq_len: 16}
trainer:
  mixed_precision: {mode: "off"}
optimizer:
  name: %(optimizer)s
  _set_:
    config: %(optimizer_config)s
lr_scheduler:
  name: passthrough
  _set_: {config: null}
regime: {num_steps: %(steps)d, checkpoint_every_n_steps: 4, publish_metrics_every_n_steps: 4}
common:
  no_sweep_dir: true
  metric_recorders: {tensorboard: {enabled: false}}
"""
DECENTRALIZED = (  # every rank a worker of aer, float32 parameters: the adapter's mechanics, not the default
    "{lr: 1.0e-2, topology: aer, exchange: parameters, average_every: 0, intra_node: gossip, "
    "second_moment: all_ranks, local_world_size: 1, bucket_size_mb: 0.01}"
)


def train(out: Path, steps: int, world: int = WORLD, optimizer: str = "decentralized_adam",
          optimizer_config: str = DECENTRALIZED, crash: str | None = None) -> str:  # fmt: skip
    """Run the recipe with ``world`` processes into ``out`` (resuming from its last checkpoint, if any).

    ``crash``: ``<step>:<where>`` for the recipe's CRASH_IN_SAVE_HOOK; the run must then fail.
    Returns the run's output.
    """
    out.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}.yaml"
    config.write_text(CONFIG % {"optimizer": optimizer, "optimizer_config": optimizer_config, "steps": steps})
    args = [RECIPE, "--config-file", str(config), "--no-rich", "--no-exit-on-error", str(out)]
    if world > 1:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), *args]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FAIRSEQ2_EXTENSION_TRACE": "1",  # an extension that fails to load raises instead of warning
        "PYTHONPATH": str(ROOT),
    }
    if crash is not None:
        env["CRASH_IN_SAVE_HOOK"] = crash
    process = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=400, env=env, cwd=ROOT
    )
    output = process.stdout[-4000:] + process.stderr[-8000:]
    assert (process.returncode != 0) == (crash is not None), output
    return output


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step}"


def rank_state(out: Path, step: int, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(
        step_dir(out, step) / "decentadam" / f"rank-{rank:05d}.pt", weights_only=True
    )
    return state


def saved_model(out: Path, step: int) -> dict[str, torch.Tensor]:
    files = sorted((step_dir(out, step) / "model").rglob("*.pt"))
    assert len(files) == 1, files
    model: dict[str, torch.Tensor] = torch.load(files[0], weights_only=True)
    return model


def probe(out: Path, rank: int, first_step: int = 0) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((out / "probe" / f"rank{rank}-{first_step}.json").read_text())
    return record


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fairseq2")
    a, b, c = base / "a", base / "b", base / "c"
    train(a, steps=8)
    shutil.copytree(a, c, ignore=shutil.ignore_patterns("probe"))
    shutil.rmtree(step_dir(c, 8))  # C resumes from A's asynchronously saved step 4
    train(c, steps=8)
    train(b, steps=4)  # saved at the end of training (blocking)
    train(b, steps=8)
    return {"a": a, "b": b, "c": c}


def test_optimizer_selected_by_name_and_no_gradient_all_reduce(runs: dict[str, Path]) -> None:
    records = [probe(runs["a"], rank) for rank in range(WORLD)]
    for record in records:
        assert record["optimizer"] == "DecentralizedAdam"
        assert record["wrapped"] == "DistributedDataParallel"  # fairseq2 still wraps the model
        # each rank's gradient is that of its own mean loss: not all-reduced, not scaled by the world
        assert record["first_grad_vs_local_mean_loss"] == 0.0
        assert len(record["grad_norms"]) == 8
    # DDP's all-reduce would make every rank's gradient (and norm) the same at every step
    for norm0, norm1 in zip(records[0]["grad_norms"], records[1]["grad_norms"], strict=True):
        assert norm0 != norm1
    ranks = [rank_state(runs["a"], 8, rank)["model"] for rank in range(WORLD)]
    assert any(not torch.equal(ranks[0][key], ranks[1][key]) for key in ranks[0])


def test_checkpoint_model_is_the_consensus_and_each_rank_keeps_its_own(runs: dict[str, Path]) -> None:
    out = runs["a"]
    for step in (4, 8):
        meta = json.loads((step_dir(out, step) / "decentadam" / "meta.json").read_text())
        assert (meta["world_size"], meta["topology"], meta["local_world_size"]) == (WORLD, "aer", 1)
        assert meta["step"] == step and meta["extra"] == {"fairseq2_step": step}
        own = [rank_state(out, step, rank) for rank in range(WORLD)]
        consensus = saved_model(out, step)
        assert consensus.keys() == own[0]["model"].keys()
        for key, value in consensus.items():
            mean = (own[0]["model"][key] + own[1]["model"][key]) / WORLD
            torch.testing.assert_close(value, mean, rtol=0, atol=0)
        for state in own:
            assert state["optimizer"]["decentralized"]["step"] == step


@pytest.mark.parametrize("resumed", ["c", "b"])
def test_resume_continues_exactly(runs: dict[str, Path], resumed: str) -> None:
    """C resumed from an asynchronously saved checkpoint, B from one saved at the end of training."""
    assert probe(runs[resumed], 0, first_step=4)["first_step"] == 4  # it did resume, at step 4
    assert_same_run(runs[resumed], runs["a"])


def assert_same_run(out: Path, reference: Path) -> None:
    """Each rank's weights and optimizer state, and the consensus model, at step 8: bitwise the same."""
    for rank in range(WORLD):
        expected, got = rank_state(reference, 8, rank), rank_state(out, 8, rank)
        for key, value in expected["model"].items():
            torch.testing.assert_close(got["model"][key], value, rtol=0, atol=0)
        want, have = expected["optimizer"], got["optimizer"]
        assert have["decentralized"] == want["decentralized"]
        for index, param_state in want["state"].items():
            for name, tensor in param_state.items():
                torch.testing.assert_close(have["state"][index][name], tensor, rtol=0, atol=0)
    consensus, expected_consensus = saved_model(out, 8), saved_model(reference, 8)
    for key, value in expected_consensus.items():
        torch.testing.assert_close(consensus[key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("crash", "resumes_at"),
    [
        ("8:start", 4),  # the blocking save at the end; nothing of ours written: rank 0's own weights
        ("4:meta", 0),  # the asynchronous save, consensus and rank files written, no meta.json
    ],
)
def test_a_crash_in_the_save_hook_leaves_a_checkpoint_the_next_run_discards(
    runs: dict[str, Path], tmp_path: Path, crash: str, resumes_at: int
) -> None:
    out = tmp_path / "crashed"
    train(out, steps=8, crash=crash)
    step = int(crash.split(":")[0])
    committed = step_dir(out, step)
    assert (committed / "trainer").is_dir(), "fairseq2 committed the checkpoint before its hook ran"
    assert files.is_unfinished(committed) and not files.is_checkpoint(committed)
    if crash.endswith("start"):  # the model file is rank 0's own weights: what a resume must not use
        own = rank_state(runs["a"], step, 0)["model"]
        assert all(torch.equal(value, own[key]) for key, value in saved_model(out, step).items())

    shutil.rmtree(out / "probe")  # the next run's probe records only
    output = train(out, steps=8)
    assert "never completed" in output  # the warning naming the discarded checkpoint
    assert probe(out, 0, first_step=resumes_at)["first_step"] == resumes_at
    assert not any(files.is_unfinished(d) for d in (out / "checkpoints").glob("step_*"))
    assert_same_run(out, runs["a"])


def test_an_unfinished_checkpoint_is_refused_at_load(runs: dict[str, Path], tmp_path: Path) -> None:
    """The load hook's guard, for a directory that turns up after the optimizer's start."""
    out = tmp_path / "late"
    shutil.copytree(runs["a"], out, ignore=shutil.ignore_patterns("probe"))
    facade = DecentralizedFacade.__new__(DecentralizedFacade)  # the load hook's inputs only
    facade._restoring = False
    facade.optimizer = Mock()
    facade.checkpoint_dir = out / "checkpoints"
    facade.checkpoint_manager = Mock(maybe_get_last_step_number=Mock(return_value=8))
    files.meta_file(step_dir(out, 8)).unlink()
    with pytest.raises(RuntimeError, match=r"refusing to resume from .*step_8"):
        facade._after_load(Mock())


def test_accum_adamw_by_name_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "accum"
    train(out, steps=2, world=1, optimizer="accum_adamw", optimizer_config="{lr: 1.0e-3, accum_steps: 2}")
    assert probe(out, 0)["optimizer"] == "AccumAdamW"
    assert not (step_dir(out, 2) / "decentadam").exists()  # a DDP optimizer: fairseq2's checkpoint as is


@pytest.mark.parametrize(
    ("trainer", "model", "message"),
    [
        (TrainerSection(data_parallelism="fsdp"), ModelSection(), "cannot run under FSDP"),
        (TrainerSection(grad_check=True), ModelSection(), "trainer.grad_check: false"),
        (
            TrainerSection(mixed_precision=MixedPrecisionConfig(mode="static", dtype=torch.float16)),
            ModelSection(),
            "Train in bf16",
        ),
        (
            TrainerSection(mixed_precision=MixedPrecisionConfig(mode="off")),
            ModelSection(dtype=torch.float16),
            "Train in bf16",
        ),
    ],
)
def test_unsupported_setups_are_refused(trainer: TrainerSection, model: ModelSection, message: str) -> None:
    from fairseq2.device import CPU

    with pytest.raises(ValueError, match=message):
        _check_supported(create_fake_gangs(CPU), trainer, model)


def test_config_validation_names_the_field() -> None:
    assert not DecentralizedAdamConfig().validate().has_error()
    errors = str(DecentralizedAdamConfig(lr=-1.0, accum_steps=0, bucket_size_mb=0).validate())
    assert "lr" in errors and "accum_steps" in errors and "bucket_size_mb" in errors
    assert "unknown topology 'star'" in str(DecentralizedAdamConfig(topology="star").validate())


def test_config_validation_is_the_library_s() -> None:
    """The config maps onto decentadam.options.make_setting: its errors are the library's, in its words
    (tests/test_options.py feeds every refused combination through each configuration)."""
    assert DecentralizedAdamConfig(setting="accumadam").to_setting() == SETTINGS["accumadam"]
    assert DecentralizedAdamConfig().to_setting() == SETTINGS["default"]  # no argument: the default
    assert not DecentralizedAdamConfig(exchange="bf16_updates", topology="complete").validate().has_error()
    errors = str(DecentralizedAdamConfig(exchange="fp8").validate())
    assert "exchange must be 'parameters' or 'bf16_updates', got 'fp8'." in errors
    node = {"intra_node": "all_reduce", "second_moment": "group_gradient"}
    assert not DecentralizedAdamConfig(share_second_moment_every=2, **node).validate().has_error()
    errors = str(DecentralizedAdamConfig(share_second_moment_every=2).validate())
    assert "share_second_moment_every=2 shares the nodes' second_moment='group_gradient' estimate" in errors
    errors = str(
        DecentralizedAdamConfig(intra_node="all_reduce", second_moment="group_gradient", v_every=2).validate()
    )
    assert "v_every=2: with intra_node='all_reduce'" in errors and "leave v_every out" in errors
    gossip = DecentralizedAdamConfig(intra_node="gossip", second_moment="group_gradient", v_every=2)
    assert not gossip.validate().has_error()
