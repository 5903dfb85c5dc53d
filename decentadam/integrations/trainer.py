"""Decentralized training with the Hugging Face Trainer: ``DecentralizedTrainer``.

::

    args = TrainingArguments(output_dir="out", learning_rate=7e-4, adam_beta2=0.999, ...)
    trainer = DecentralizedTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=val,
        decentralized=DecentralizedArguments(setting="accumadam"),
    )
    trainer.train()

launched as usual (``accelerate launch --multi_gpu --num_processes 8 train.py`` or
``torchrun --nproc_per_node 8 train.py``). What changes against ``Trainer``:

- the optimizer is a :class:`~decentadam.DecentralizedAdam` built from the TrainingArguments
  (learning rate, betas, epsilon, weight decay without decay on biases and norms) and
  :class:`DecentralizedArguments`; or pass your own with ``optimizers=(DecentralizedAdam(...), None)``;
- the model is not wrapped in DistributedDataParallel: no gradient all-reduce;
- ``average_tokens_across_devices`` is turned off. Trainer assumes DDP averages gradients over
  ranks: with that option it normalises each rank's loss by the token count of *all* ranks and
  multiplies it by the number of processes, which costs an all-gather per step. Without averaging
  each rank's gradient must be the gradient of its own mean loss, exactly as in a single process;
- evaluation and ``save_model`` use the consensus model (the exact average over ranks, BatchNorm
  statistics included); training continues from each rank's own weights afterwards;
- checkpoints hold the consensus weights (``from_pretrained`` loads them) plus, per rank,
  ``decentadam/rank-XXXXX.pt`` with its own weights and optimizer state, so
  ``train(resume_from_checkpoint=...)`` continues exactly; ``resume_from_checkpoint=True`` skips
  checkpoints left incomplete by a killed run. Resuming on another world size starts every rank
  from the consensus weights, with a warning;
- training logs carry ``decentadam/consensus_distance``, ``decentadam/consensus_distance_rel``,
  ``decentadam/comm_wait_ms`` and ``decentadam/comm_mb`` at every ``logging_steps``;
- fp16 loss scaling skips a step on every rank when any rank overflows.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import Trainer

from decentadam import checkpoint_files as files
from decentadam.amp import SyncedGradScaler
from decentadam.consensus import averaged, metrics, unwrap_optimizer
from decentadam.decentralized import CommStats, DecentralizedAdam
from decentadam.options import Comm, Setting, setting_of

__all__ = ["DecentralizedArguments", "DecentralizedTrainer", "last_complete_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass
class DecentralizedArguments:
    """How :class:`DecentralizedTrainer` builds its :class:`~decentadam.DecentralizedAdam`.

    The learning rate, betas, epsilon and weight decay come from ``TrainingArguments``. ``setting``
    names one of :data:`decentadam.SETTINGS` (docs/choosing.md); the options after it, flat as in a
    configuration file, change it (None: the setting's), by the rules of
    :func:`decentadam.options.make_setting`, checked here.
    """

    setting: str | None = None
    """A name of ``decentadam.SETTINGS``; None: "default" (or "accumadam" with accum_steps > 1)."""
    topology: str | None = None
    """Graph schedule: "complete", "ring", "one-peer-exp" or "aer" (alternating exponential ring)."""
    exchange: Literal["parameters", "bf16_updates"] | None = None
    """"parameters" or "bf16_updates" (each rank's update from a shared reference point in bfloat16)."""
    average_every: int | None = None
    """Every that many steps the exchange is the exact average over all ranks (0: never)."""
    intra_node: Literal["gossip", "all_reduce"] | None = None
    """"gossip" (every rank a worker of the topology) or "all_reduce" (the ranks of a node all-reduce
    their gradients before each step and only nodes gossip)."""
    second_moment: Literal["all_ranks", "local", "group_gradient", "global"] | None = None
    """The second moment the update divides by (decentadam.options: AllRanks, Local, GroupGradient...)."""
    v_every: int | None = None
    """With second_moment="group_gradient" under gossip: steps between two gradient exchanges (2)."""
    share_second_moment_every: int | None = None
    """With intra_node="all_reduce" and second_moment="group_gradient": share the nodes' estimate
    with every k-th exchange (0: not shared)."""
    sync_steps: int | None = None
    """The first this many steps wait for their exchange and mix at once (a synchronous warm-up)."""
    accum_steps: int | None = None
    """AccumAdam window s (second_moment="local"); alone, > 1 selects the setting "accumadam"."""
    local_world_size: int | None = None
    """Ranks per node for "aer" and intra_node; default: LOCAL_WORLD_SIZE set by the launcher."""
    bucket_size_mb: float = 25.0
    """Size of one communication bucket."""
    overlap: Literal["step", "backward"] = "step"
    """"step" works with gradient clipping and accumulation; "backward" also overlaps the update."""
    timeout: float | None = None
    """Seconds to wait for one exchange before failing (a peer died or stalled); None: the
    process group's timeout."""
    hierarchical: bool = True
    """On gloo, sum groups that span nodes in three phases (less inter-node traffic); False: one
    flat all-reduce per group. NCCL keeps its own all-reduce either way."""
    log_metrics: bool = True
    """Add consensus distance and communication wait to the training logs."""

    def __post_init__(self) -> None:
        self.to_setting()  # bad values and combinations fail here, before training starts
        self.to_comm()

    def to_setting(self) -> Setting:
        """The :class:`~decentadam.options.Setting` these arguments describe."""
        return setting_of(self)

    def to_comm(self) -> Comm:
        """The :class:`~decentadam.options.Comm` these arguments describe."""
        return Comm(
            local_world_size=self.local_world_size,
            bucket_size_mb=self.bucket_size_mb,
            overlap=self.overlap,
            timeout=self.timeout,
            hierarchical=self.hierarchical,
        )


class DecentralizedTrainer(Trainer):
    """``transformers.Trainer`` that trains with :class:`~decentadam.DecentralizedAdam` (see module doc)."""

    def __init__(
        self, *args: Any, decentralized: DecentralizedArguments | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.decentralized = decentralized or DecentralizedArguments()
        if self.args.average_tokens_across_devices:
            self.args.average_tokens_across_devices = False
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "decentralized training keeps a full model on every rank; it cannot run with DeepSpeed or "
                "FSDP. Remove the deepspeed / fsdp training arguments."
            )
        self._check_backward_overlap()
        self._metrics_since: CommStats | None = None

    def _check_backward_overlap(self) -> None:
        """overlap="backward" updates each bucket inside backward: nothing may act on the gradients later."""
        overlap = self.decentralized.overlap
        if self.optimizer is not None:
            overlap = _decentralized_adam(self.optimizer).overlap
        if overlap != "backward":
            return
        if self.args.gradient_accumulation_steps > 1:
            raise ValueError(
                "DecentralizedArguments(overlap='backward') cannot accumulate gradients over "
                f"{self.args.gradient_accumulation_steps} micro-batches; use overlap='step'"
            )
        if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
            raise ValueError(
                f"overlap='backward' updates the weights during backward, before Trainer clips gradients to "
                f"max_grad_norm={self.args.max_grad_norm}, so clipping would do nothing. Use overlap='step' "
                "(DecentralizedArguments(overlap='step')), or set TrainingArguments(max_grad_norm=0) to "
                "train without clipping."
            )
        if self.accelerator.scaler is not None and self.accelerator.scaler.is_enabled():
            raise ValueError(
                "overlap='backward' updates the weights during backward with the loss-scaled gradients, "
                "before the fp16 loss scaler can unscale them or skip an overflowing step. Use "
                "overlap='step' (DecentralizedArguments(overlap='step')) with fp16, or train in bf16."
            )

    # ---------------------------------------------------------------- optimizer and model wrapping

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.accelerator.scaler is not None and not isinstance(self.accelerator.scaler, SyncedGradScaler):
            self.accelerator.scaler = SyncedGradScaler.replacing(self.accelerator.scaler)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            _decentralized_adam(self.optimizer)  # a user-supplied optimizer must be a DecentralizedAdam
            return self.optimizer
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("DecentralizedTrainer needs a model to build its optimizer")
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        config = self.decentralized
        self.optimizer = DecentralizedAdam(
            [g for g in groups if g["params"]],
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            setting=config.to_setting(),
            comm=config.to_comm(),
        )
        return self.optimizer

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        model = super()._wrap_model(model, training, dataloader)
        if training and model is self.model and not getattr(model, "_is_accelerate_prepared", False):
            # Device placement and autocast, no DistributedDataParallel; accelerator.prepare then
            # treats the model as already prepared.
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
            setattr(model, "_is_accelerate_prepared", True)  # noqa: B010 (not an nn.Module attribute)
        return model

    def _decentralized(self) -> DecentralizedAdam | None:
        return _decentralized_adam(self.optimizer) if self.optimizer is not None else None

    def _module(self) -> nn.Module:
        if self.model is None:
            raise ValueError("DecentralizedTrainer has no model")
        return self.model

    # ---------------------------------------------------------------- consensus for eval and save

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Evaluate the consensus model (exact average over ranks); local weights come back after."""
        opt = self._decentralized()
        if opt is None or opt.world_size == 1:
            return dict(super().evaluate(*args, **kwargs))
        with averaged(self._module(), opt):
            return dict(super().evaluate(*args, **kwargs))

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Predict with the consensus model, as :meth:`evaluate` does; local weights come back after."""
        opt = self._decentralized()
        if opt is None or opt.world_size == 1:
            return super().predict(*args, **kwargs)
        with averaged(self._module(), opt):
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the consensus model (call on every rank: averaging is a collective)."""
        opt = self._decentralized()
        if opt is None or opt.world_size == 1:
            super().save_model(output_dir, _internal_call)
            return
        with averaged(self._module(), opt):
            super().save_model(output_dir, _internal_call)

    # ---------------------------------------------------------------- per-rank state

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        opt = self._decentralized()
        if opt is None:
            return
        files.state_dir(Path(output_dir)).mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.accelerator.unwrap_model(self.model).state_dict(),
            "optimizer": opt.state_dict(),
        }
        files.save_rank_state(Path(output_dir), opt.rank, state)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)  # rng_state_<rank>.pth, each rank its own
        opt = self._decentralized()
        if opt is None:
            return
        # The completion marker comes last: once every rank's state and RNG files are written.
        self.accelerator.wait_for_everyone()
        if opt.rank == 0:
            files.write_meta(Path(output_dir), files.RunShape.of(opt, opt.world_size), opt.step_count)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        opt = self._decentralized()
        if checkpoint is None or opt is None:
            return
        self._load_own_state(Path(checkpoint), opt)

    def _load_own_state(self, checkpoint: Path, opt: DecentralizedAdam) -> None:
        if not files.is_checkpoint(checkpoint):
            warnings.warn(
                f"{checkpoint} has no per-rank decentadam state: every rank resumes from the consensus "
                "weights and rank 0's optimizer state.",
                UserWarning,
                stacklevel=3,
            )
            return
        meta = files.read_meta(checkpoint)
        exact = files.check_resumable(
            meta,
            files.RunShape.of(opt, opt.world_size),
            checkpoint,
            allow_topology_change=False,
            fix=f"Resume with DecentralizedArguments(topology={meta['topology']!r}, "
            f"local_world_size={meta.get('local_world_size')}), or start a new run from the checkpoint's "
            "consensus weights (from_pretrained), without resume_from_checkpoint.",
        )
        if not exact:
            message = (
                f"checkpoint {checkpoint} was saved by {meta['world_size']} ranks and is resumed by "
                f"{opt.world_size}: every rank starts from the consensus (averaged) weights with rank 0's "
                "optimizer state."
            )
            warnings.warn(message, UserWarning, stacklevel=3)
            logger.warning(message)
            return
        # Trainer loaded the consensus weights and rank 0's optimizer; each rank takes its own back.
        state = files.load_rank_state(checkpoint, opt.rank)
        self.accelerator.unwrap_model(self.model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _last_complete_checkpoint(self.args.output_dir or ".")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---------------------------------------------------------------- logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        opt = self._decentralized()
        # Training logs happen on every rank at the same step (Trainer gathers the loss there too).
        if self.decentralized.log_metrics and opt is not None and "loss" in logs and opt.step_count > 0:
            logs.update(metrics(opt, since=self._metrics_since))
            self._metrics_since = opt.stats.snapshot()
        super().log(logs, start_time)


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _last_complete_checkpoint(output_dir: str) -> str:
    """The newest checkpoint-N whose Trainer state and every rank's state were written."""
    found = last_complete_checkpoint(output_dir)
    if found is None:
        raise ValueError(
            f"no complete checkpoint in {output_dir} to resume from; to start a new run when there is "
            "none, pass resume_from_checkpoint=last_complete_checkpoint(output_dir)"
        )
    return found


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` whose Trainer state and every rank's state were
    written, or None: ``train(resume_from_checkpoint=last_complete_checkpoint(dir))`` resumes when
    there is one and starts a new run when there is none (a launcher's automatic restart).
    Incomplete ones (a run killed while saving) are skipped with a warning."""
    candidates = []
    for entry in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = _CHECKPOINT.match(entry)
        if match:
            candidates.append((int(match.group(1)), os.path.join(output_dir, entry)))
    for _, path in sorted(candidates, reverse=True):
        if _is_complete(Path(path)):
            return path
        logger.warning("skipping %s: incomplete (a run was probably killed while saving it)", path)
    return None


def _is_complete(path: Path) -> bool:
    """Trainer state, our marker (written after every rank's files), and every rank's files."""
    try:
        json.loads((path / "trainer_state.json").read_text())
        world_size = int(files.read_meta(path)["world_size"])
    except (OSError, ValueError):
        return False
    if files.missing_rank_files(path, world_size):
        return False
    # Trainer names its RNG file rng_state.pth in one process
    return world_size == 1 or all((path / f"rng_state_{r}.pth").is_file() for r in range(world_size))


def _decentralized_adam(optimizer: Any) -> DecentralizedAdam:
    inner = unwrap_optimizer(optimizer)
    if not isinstance(inner, DecentralizedAdam):
        raise TypeError(
            "DecentralizedTrainer trains with DecentralizedAdam (synchronous gossip); train A2CiD2 with "
            "the Accelerate integration (decentadam.integrations.accelerate.prepare) or a plain loop"
        )
    return inner
