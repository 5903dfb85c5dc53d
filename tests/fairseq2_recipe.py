"""A tiny fairseq2 training recipe for tests/test_fairseq2.py: a 2-layer LLaMA on synthetic tokens.

Run by the test under torchrun, the way a fairseq2 user runs a recipe::

    python -m torch.distributed.run --nproc_per_node 2 tests/fairseq2_recipe.py \\
        --config-file config.yaml --no-rich --no-exit-on-error OUTPUT_DIR

The config file selects the optimizer by name. Each rank reads its own synthetic stream (a
function of the seed, its rank and the batch index, so the data reader's state is one integer).
Besides fairseq2's checkpoints, every rank writes ``OUTPUT_DIR/probe/rank<r>-<first step>.json``:
the gradient norm of each step, and whether its first step's gradient is the gradient of its own
mean loss.

``CRASH_IN_SAVE_HOOK=<step>:<where>`` kills the processes inside the adapter's checkpoint save hook
of step ``<step>``, after fairseq2 has committed the checkpoint: ``start`` on every rank before any
of the adapter's files is written, ``meta`` on rank 0 just before ``meta.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fairseq2.datasets import DataReader, SequenceBatch
from fairseq2.metrics import Mean, MetricBag
from fairseq2.recipe import Recipe, RecipeContext, main
from fairseq2.recipe.config import (
    CommonSection,
    GangSection,
    LRSchedulerSection,
    MixedPrecisionConfig,
    ModelSection,
    OptimizerSection,
    RegimeSection,
    TrainerSection,
)
from fairseq2.task import Task
from fairseq2.trainer import TrainUnit
from torch import Tensor, nn

from decentadam import checkpoint_files
from decentadam.integrations.fairseq2 import create_trainer


@dataclass(kw_only=True)
class DataSection:
    batch_size: int = 4
    """Sequences per batch."""
    seq_len: int = 16
    """Tokens per sequence (plus one for the shifted targets)."""
    num_accumulate: int = 1
    """Batches per step (fairseq2's gradient accumulation)."""
    vocab_size: int = 64
    """Tokens are drawn from [1, vocab_size): the model's vocabulary size."""


@dataclass(kw_only=True)
class TinyConfig:
    model: ModelSection = field(default_factory=lambda: ModelSection(family="llama"))
    data: DataSection = field(default_factory=DataSection)
    gang: GangSection = field(default_factory=GangSection)
    trainer: TrainerSection = field(
        default_factory=lambda: TrainerSection(mixed_precision=MixedPrecisionConfig(mode="off"))
    )
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    regime: RegimeSection = field(default_factory=RegimeSection)
    common: CommonSection = field(default_factory=CommonSection)


class SyntheticReader(DataReader[SequenceBatch]):
    """Random tokens; batch ``i`` of rank ``r`` depends on (seed, r, i) only."""

    def __init__(self, config: DataSection, seed: int, rank: int) -> None:
        self.config, self.seed, self.rank = config, seed, rank
        self.index = 0

    def __iter__(self) -> SyntheticReader:
        return self

    def __next__(self) -> list[SequenceBatch]:
        batches = []
        for _ in range(self.config.num_accumulate):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.index)
            self.index += 1
            shape = (self.config.batch_size, self.config.seq_len + 1)
            seqs = torch.randint(1, self.config.vocab_size, shape, generator=generator)  # (B, T + 1)
            batches.append(SequenceBatch(seqs, None))
        return batches

    def reset(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, object]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        index = state_dict["index"]
        assert isinstance(index, int)
        self.index = index

    @property
    def num_accumulate(self) -> int:
        return self.config.num_accumulate


class LMUnit(TrainUnit[SequenceBatch]):
    """Summed next-token loss and its target count: the usual fairseq2 unit."""

    def __init__(self, model: nn.Module) -> None:
        self.network = model  # not `model`: TrainUnit has a deprecated property of that name
        self.last_batch: SequenceBatch | None = None

    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        metric_bag.add("nll_loss", Mean())

    def process_batch(self, batch: SequenceBatch, metric_bag: MetricBag) -> tuple[Tensor, int | None]:
        self.last_batch = batch
        loss, num_targets = lm_loss(self.network, batch)
        metric_bag.get("nll_loss", Mean).update(loss.detach() / num_targets, weight=num_targets)
        return loss, num_targets


def lm_loss(model: nn.Module, batch: SequenceBatch) -> tuple[Tensor, int]:
    inputs, targets = batch.as_auto_regressive()
    seqs, layout = inputs.as_input()
    loss: Tensor = model(seqs, layout, targets=targets.seqs, reduction="sum")
    return loss, targets.num_target_elements


class Probe:
    """Records each step's gradient norm, and the first step's gradient against the local mean loss."""

    def __init__(self, context: RecipeContext, unit: LMUnit) -> None:
        self.module = context.get_model()
        self.unit = unit
        self.rank = context.gangs.dp.rank
        self.directory = context.output_dir / "probe"
        self.directory.mkdir(parents=True, exist_ok=True)
        wrapped = type(context.get_data_parallel_model()).__name__
        self.record: dict[str, Any] = {"grad_norms": [], "wrapped": wrapped}
        context.get_optimizer().register_step_pre_hook(self.before_step)

    def before_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        self.record["grad_norms"].append(float(norm))
        if "first_step" not in self.record:
            self.record["first_step"] = int(getattr(optimizer, "step_count", 0))
            self.record["optimizer"] = type(optimizer).__name__
            assert self.unit.last_batch is not None
            # the gradient of this rank's mean loss on its batch, at the same weights (before the update)
            grads = [g.clone() for g in grads]
            self.module.zero_grad(set_to_none=True)
            loss, num_targets = lm_loss(self.module, self.unit.last_batch)
            (loss / num_targets).backward()
            expected = [p.grad for p in self.module.parameters() if p.grad is not None]
            self.record["first_grad_vs_local_mean_loss"] = max(
                float((a - b).abs().max()) for a, b in zip(grads, expected, strict=True)
            )
            with_grads = [p for p in self.module.parameters() if p.grad is not None]
            for param, grad in zip(with_grads, grads, strict=True):
                param.grad = grad  # the trainer's gradient goes on to the step
        path = self.directory / f"rank{self.rank}-{self.record['first_step']}.json"
        path.write_text(json.dumps(self.record))


class TinyRecipe(Recipe):
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(TinyConfig)
        model = context.get_data_parallel_model()
        unit = LMUnit(model)
        reader = SyntheticReader(config.data, config.common.seed, context.gangs.dp.rank)
        trainer = create_trainer(context, unit, reader)  # before the probe: it must build the optimizer
        Probe(context, unit)
        return trainer

    @property
    def config_kls(self) -> type[object]:
        return TinyConfig


def crash_in_save_hook(spec: str) -> None:
    """Make the adapter's save hook of one step kill the process (see the module docstring)."""
    step, where = spec.split(":")
    target = {"start": "save_rank_state", "meta": "write_meta"}[where]
    original = getattr(checkpoint_files, target)

    def crash(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path.name == f"step_{step}":
            os._exit(13)
        return original(path, *args, **kwargs)

    setattr(checkpoint_files, target, crash)


if __name__ == "__main__":
    if "CRASH_IN_SAVE_HOOK" in os.environ:
        crash_in_save_hook(os.environ["CRASH_IN_SAVE_HOOK"])
    main(TinyRecipe())
