"""Decentralized training in fairseq2 recipes: ``decentralized_adam`` and ``accum_adamw`` optimizers.

Needs the ``fairseq2`` extra in its own environment (``docs/fairseq2.md``). The ``fairseq2.extension``
entry point of this package registers both optimizers with every fairseq2 program of that
environment; a recipe config selects one by name (``_set_`` replaces the default AdamW config)::

    optimizer:
      name: decentralized_adam
      _set_:
        config: {lr: 7.0e-4, betas: [0.9, 0.999], setting: accumadam}

and the recipe builds its trainer with :func:`create_trainer` instead of ``context.create_trainer``::

    def create_task(self, context: RecipeContext) -> Task:
        unit = MyTrainUnit(context.get_data_parallel_model())
        return create_trainer(context, unit, data_reader)      # any optimizer; adapts for ours

With ``decentralized_adam`` no gradient is all-reduced (the optimizer holds DDP's ``no_sync()``
for the run; its parameter exchange over fairseq2's data-parallel gang is the only communication),
each rank's gradient is that of its own mean loss (:class:`LocalNormalization`) and is clipped on
its own, and every checkpoint holds the consensus model in fairseq2's model file plus each rank's own
weights and optimizer state in ``step_N/decentadam/`` (:mod:`decentadam.checkpoint_files`), from
which a resumed run continues exactly. What is refused, what is not covered, and what this relies
on in fairseq2 beyond its promises: ``docs/fairseq2.md``. ``accum_adamw`` is the purely local
AccumAdamW under fairseq2's ordinary DDP: none of this applies to it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
from fairseq2.checkpoint import CheckpointDir, CheckpointManager
from fairseq2.file_system import FileSystem
from fairseq2.gang import Gangs
from fairseq2.metrics import MetricBag
from fairseq2.nn.data_parallel import (
    DataParallelFacade,
    get_data_parallel_facade,
    set_data_parallel_facade,
)
from fairseq2.nn.utils.grad import clip_grad_norm
from fairseq2.nn.utils.module import load_state_dict
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.component import register_component
from fairseq2.recipe.config import Default, ModelSection, ParameterGroupConfig, TrainerSection, default
from fairseq2.recipe.optim import prepare_parameter_groups
from fairseq2.runtime.dependency import DependencyContainer, DependencyResolver
from fairseq2.trainer import Trainer, TrainStepHookArgs, TrainUnit
from fairseq2.utils.validation import ValidationResult
from torch import Tensor, nn
from torch.optim import Optimizer

from decentadam import checkpoint_files as files
from decentadam.consensus import averaged
from decentadam.decentralized import DecentralizedAdam
from decentadam.optim.accum_adamw import AccumAdamW, make_defaults
from decentadam.options import Comm, Setting, setting_of

__all__ = [
    "ACCUM_ADAMW",
    "DECENTRALIZED_ADAM",
    "AccumAdamWConfig",
    "AccumAdamWGroupConfig",
    "DecentralizedAdamConfig",
    "DecentralizedFacade",
    "LocalNormalization",
    "create_trainer",
    "register",
]

logger = logging.getLogger(__name__)

DECENTRALIZED_ADAM: Final = "decentralized_adam"
ACCUM_ADAMW: Final = "accum_adamw"


# ---------------------------------------------------------------------------- configs


@dataclass(kw_only=True)
class AccumAdamWGroupConfig(ParameterGroupConfig):
    """One parameter group (``params``: name regex(es)); unset fields take the top-level value."""

    lr: float | Default = default
    betas: tuple[float, float] | Default = default
    eps: float | Default = default
    weight_decay: float | Default = default
    """Set 0.0 in a group matching biases and norms to leave them undecayed, as with AdamW."""


@dataclass(kw_only=True)
class _AdamConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    foreach: bool | None = None
    """Multi-tensor update path; None: on CPU and CUDA."""
    groups: Sequence[AccumAdamWGroupConfig] = field(default_factory=list)
    """Parameter groups; each parameter joins the first group whose ``params`` regex matches its name."""


@dataclass(kw_only=True)
class AccumAdamWConfig(_AdamConfig):
    """``optimizer.config`` of ``accum_adamw``: :class:`~decentadam.AccumAdamW` (purely local)."""

    accum_steps: int = 1
    """AccumAdam window s: the Adam moments advance once per s steps with the window's mean gradient."""

    def validate(self) -> ValidationResult:
        hyper = self.lr, self.betas, self.eps, self.weight_decay
        return _validated(lambda: make_defaults(*hyper, self.accum_steps, None))


@dataclass(kw_only=True)
class DecentralizedAdamConfig(_AdamConfig):
    """``optimizer.config`` of ``decentralized_adam``: :class:`~decentadam.DecentralizedAdam`.

    ``setting`` names one of ``decentadam.SETTINGS`` (docs/choosing.md); the options after it
    change it (None: the setting's), by the rules of :func:`decentadam.options.make_setting`."""

    setting: str | None = None
    """A name of ``decentadam.SETTINGS``; None: "default" (or "accumadam" with accum_steps > 1)."""
    topology: str | None = None
    """Graph schedule: "complete", "ring", "one-peer-exp" or "aer" (alternating exponential ring)."""
    exchange: str | None = None
    """"parameters" or "bf16_updates" (each rank's update from a shared reference point in bfloat16)."""
    average_every: int | None = None
    """Every that many steps the exchange is the exact average over all ranks (0: never)."""
    intra_node: str | None = None
    """"gossip" (every rank a worker of the topology) or "all_reduce" (the ranks of a node all-reduce
    their gradients before each step and only nodes gossip)."""
    second_moment: str | None = None
    """"all_ranks", "local", "group_gradient" or "global" (decentadam.options)."""
    v_every: int | None = None
    """With second_moment "group_gradient" under gossip: steps between two gradient exchanges (2)."""
    share_second_moment_every: int | None = None
    """With intra_node "all_reduce" and second_moment "group_gradient": share the nodes' estimate
    with every k-th exchange (0: not shared)."""
    sync_steps: int | None = None
    """The first this many steps wait for their exchange and mix at once (a synchronous warm-up)."""
    accum_steps: int | None = None
    """AccumAdam window s (second_moment "local"); alone, > 1 selects the setting "accumadam"."""
    local_world_size: int | None = None
    """Ranks per node for "aer" and intra_node; None: LOCAL_WORLD_SIZE set by torchrun."""
    bucket_size_mb: float = 25.0
    """Size of one communication bucket."""
    timeout: float | None = None
    """Seconds to wait for one exchange before failing (a peer died or stalled); None: the gang's timeout."""
    hierarchical: bool = True
    """On gloo, sum groups that span nodes in three phases; False: one flat all-reduce per group."""

    def validate(self) -> ValidationResult:
        hyper = self.lr, self.betas, self.eps, self.weight_decay
        return _validated(lambda: make_defaults(*hyper, 1, None), self.to_setting, self.to_comm)

    def to_setting(self) -> Setting:
        """The :class:`~decentadam.options.Setting` this config describes."""
        return setting_of(self)

    def to_comm(self, process_group: torch.distributed.ProcessGroup | None = None) -> Comm:
        """The :class:`~decentadam.options.Comm` this config describes, over ``process_group``."""
        return Comm(
            local_world_size=self.local_world_size,
            process_group=process_group,
            bucket_size_mb=self.bucket_size_mb,
            timeout=self.timeout,
            hierarchical=self.hierarchical,
        )


def _validated(*checks: Callable[[], object]) -> ValidationResult:
    """fairseq2's result of ``checks``: each one's ValueError message as an error, the library's own
    words (:mod:`decentadam.options` holds the rules)."""
    result = ValidationResult()
    for check in checks:
        try:
            check()
        except ValueError as error:
            result.add_error(f"{error}.")
    return result


# ---------------------------------------------------------------------------- registration


def register(container: DependencyContainer) -> None:
    """The ``fairseq2.extension`` entry point: registers both optimizers under their names."""
    register_component(
        container, Optimizer, DECENTRALIZED_ADAM, config_kls=DecentralizedAdamConfig, factory=_decentralized
    )
    register_component(container, Optimizer, ACCUM_ADAMW, config_kls=AccumAdamWConfig, factory=_accum_adamw)


def _accum_adamw(resolver: DependencyResolver, config: AccumAdamWConfig) -> Optimizer:
    module = resolver.resolve(nn.Module, key="model")
    return AccumAdamW(
        prepare_parameter_groups(module, config.groups),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        accum_steps=config.accum_steps,
        foreach=config.foreach,
    )


def _decentralized(resolver: DependencyResolver, config: DecentralizedAdamConfig) -> Optimizer:
    gangs = resolver.resolve(Gangs)
    _check_supported(gangs, resolver.resolve(TrainerSection), resolver.resolve(ModelSection))
    module = resolver.resolve(nn.Module, key="model")  # the model itself
    dp_model = resolver.resolve(nn.Module)  # fairseq2's data-parallel wrapper of it (DDP on > 1 rank)
    if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError(
            f"{DECENTRALIZED_ADAM}: fairseq2's DDP turned the model's BatchNorm layers into SyncBatchNorm, "
            "which synchronises statistics across ranks in every forward. Decentralized training needs "
            "models without BatchNorm (LayerNorm, RMSNorm); use `adamw` for this model."
        )
    optimizer = DecentralizedAdam(
        prepare_parameter_groups(module, config.groups),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        setting=config.to_setting(),
        comm=config.to_comm(gangs.dp.as_process_group() if gangs.dp.size > 1 else None),
        foreach=config.foreach,
    )
    manager = resolver.resolve(CheckpointManager)
    checkpoint_dir = resolver.resolve(CheckpointDir).path or resolver.resolve(Path).joinpath("checkpoints")
    if not resolver.resolve(FileSystem).is_local_path(checkpoint_dir):
        raise ValueError(
            f"{DECENTRALIZED_ADAM}: checkpoint directory {checkpoint_dir} is not on a local (or mounted "
            "shared) file system; each rank writes its own state file beside fairseq2's checkpoint. Pass a "
            "--checkpoint-dir that every rank sees as a path."
        )
    _discard_unfinished(manager, checkpoint_dir, gangs)  # before the trainer picks a step to resume from
    facade = DecentralizedFacade(dp_model, module, optimizer, manager, checkpoint_dir)
    set_data_parallel_facade(dp_model, facade)  # the trainer asks the model's facade for state and norms
    return optimizer


def _discard_unfinished(manager: CheckpointManager, checkpoint_dir: Path, gangs: Gangs) -> None:
    """Delete the checkpoints whose save hook did not finish: a crash after fairseq2 committed them.

    Such a ``step_N`` holds rank 0's own weights (or the consensus) and rank 0's optimizer state,
    but not every rank's state: resuming from it would silently restart every rank from rank 0's
    weights. The trainer then resumes from the last complete checkpoint (or starts afresh).
    """
    unfinished = [
        step for step in manager.get_step_numbers() if files.is_unfinished(checkpoint_dir / f"step_{step}")
    ]
    gangs.root.barrier()  # every rank has looked before rank 0 deletes anything
    for step in unfinished:
        if gangs.root.rank == 0:
            _warn(
                f"{checkpoint_dir / f'step_{step}'} was committed by fairseq2 but its decentadam part was "
                "never completed (the run stopped inside the checkpoint save hook): deleting it; training "
                "resumes from the last complete checkpoint."
            )
        manager.delete_checkpoint(step)  # a collective: rank 0 deletes, every rank waits


def _check_supported(gangs: Gangs, trainer: TrainerSection, model: ModelSection) -> None:
    """Refuse what decentralized training cannot do, naming the setting to change."""
    keep_full_model = "decentralized training keeps a full model on every rank"
    if trainer.data_parallelism != "ddp":
        raise ValueError(
            f"{DECENTRALIZED_ADAM}: {keep_full_model}; it cannot run under FSDP. "
            "Set `trainer.data_parallelism: ddp`."
        )
    for gang, what, fix in (
        (gangs.tp, "tensor parallelism", "gang.tensor_parallel_size: 1"),
        (gangs.pp, "pipeline parallelism", "one pipeline stage"),
        (gangs.sdp, "sharded data parallelism", "`trainer.data_parallelism: ddp`"),
    ):
        if gang.size > 1:
            raise ValueError(
                f"{DECENTRALIZED_ADAM}: {keep_full_model}; it cannot run with {what} ({gang.size} ranks). "
                f"Use {fix}."
            )
    if trainer.grad_check:
        raise ValueError(
            f"{DECENTRALIZED_ADAM}: `trainer.grad_check` compares gradient norms across ranks, which "
            "differ by design in decentralized training (each rank its own gradient). Set "
            "`trainer.grad_check: false`."
        )
    mixed = trainer.mixed_precision
    dtype = model.dtype if mixed.mode == "off" else mixed.dtype
    if dtype == torch.float16:
        raise ValueError(
            f"{DECENTRALIZED_ADAM}: fp16 training needs a loss scaler that skips an overflowing step on "
            "every rank at once, and fairseq2's skips it on the overflowing rank only (under DDP the "
            "gradients are equal). "
            "Train in bf16 (`trainer.mixed_precision.dtype: bfloat16`) or float32."
        )


# ---------------------------------------------------------------------------- the trainer side


def create_trainer(
    context: RecipeContext,
    unit: TrainUnit[Any],
    data_reader: Any,
    valid_units: Sequence[Any] | None = None,
    valid_data_readers: Sequence[Any] | None = None,
) -> Trainer:
    """``context.create_trainer(...)`` that adapts it to ``decentralized_adam`` when that is selected.

    With ``decentralized_adam``: ``unit`` is wrapped in :class:`LocalNormalization` and the trainer's
    checkpoints get the consensus model and each rank's own state (module docstring). With any other
    optimizer this is ``context.create_trainer`` unchanged, so a recipe can call it always.
    """
    # Building the optimizer (fairseq2 would do it in create_trainer) sets the model's facade.
    if not isinstance(context.get_optimizer(), DecentralizedAdam):
        return context.create_trainer(unit, data_reader, valid_units, valid_data_readers)
    facade = get_data_parallel_facade(context.get_data_parallel_model())
    if not isinstance(facade, DecentralizedFacade):
        raise RuntimeError(
            f"the model's data-parallel facade is a {type(facade).__name__}, not the one "
            f"{DECENTRALIZED_ADAM} set: something replaced it (set_data_parallel_facade) after the "
            "optimizer was built"
        )
    trainer = context.create_trainer(LocalNormalization(unit), data_reader, valid_units, valid_data_readers)
    facade.attach(trainer)
    return trainer


class LocalNormalization(TrainUnit[Any]):
    """Wraps a train unit so that each rank's gradient is that of its own mean loss.

    fairseq2 normalises the summed loss of a unit that returns its number of targets by the count
    over all ranks (an all-reduce per step) and undoes DDP's division by the world size. Without DDP
    the gradient of rank i must be the gradient of rank i's mean loss, as in a single process: this
    returns ``(loss / num_targets, None)``, for which the trainer only divides by the number of
    micro-batches. Units that already return ``None`` pass through unchanged.
    """

    def __init__(self, unit: TrainUnit[Any]) -> None:
        self.unit = unit

    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        self.unit.prepare_metric_bag(metric_bag)

    def set_step_nr(self, step_nr: int) -> None:
        self.unit.set_step_nr(step_nr)

    def set_data_epoch_nr(self, data_epoch_nr: int) -> None:
        self.unit.set_data_epoch_nr(data_epoch_nr)

    def process_batch(self, batch: Any, metric_bag: MetricBag) -> tuple[Tensor, int | None]:
        loss, num_targets = self.unit.process_batch(batch, metric_bag)
        if num_targets is None:
            return loss, None
        return loss / max(num_targets, 1), None

    def process_metric_values(self, values: MutableMapping[str, object]) -> None:
        self.unit.process_metric_values(values)


class DecentralizedFacade(DataParallelFacade):
    """How fairseq2 sees the data-parallel model under decentralized training (set by the optimizer).

    fairseq2 asks a model's facade for its state, its gradient norm and ``no_sync``; this one answers
    for the model itself (this rank's weights and gradient: nothing is synchronised), holds DDP's
    ``no_sync()`` for the whole run, and links the optimizer to fairseq2's checkpoints: the
    checkpoint save hook (:meth:`attach`) writes the consensus model and the per-rank state; an
    optimizer step pre-hook lets an asynchronous save finish before the weights change; a
    ``load_state_dict`` post-hook on the optimizer gives each rank its own state back on resume.
    """

    def __init__(
        self,
        dp_model: nn.Module,
        module: nn.Module,
        optimizer: DecentralizedAdam,
        checkpoint_manager: CheckpointManager,
        checkpoint_dir: Path,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.checkpoint_manager = checkpoint_manager
        self.checkpoint_dir = checkpoint_dir
        self.attached = False
        self._hold_no_sync = contextlib.ExitStack()
        if isinstance(dp_model, nn.parallel.DistributedDataParallel):
            # Inside no_sync() DDP's forward does not prepare its reducer: backward all-reduces nothing.
            self._hold_no_sync.enter_context(dp_model.no_sync())
        self._step_hook = optimizer.register_step_pre_hook(self._before_step)
        self._load_hook = optimizer.register_load_state_dict_post_hook(self._after_load)
        self._restoring = False

    # ------------------------------------------------------------ DataParallelFacade

    def state_dict(self) -> dict[str, object]:
        """This rank's weights (fairseq2 saves rank 0's; the save hook replaces them by the consensus).

        fairseq2 asks while it stages a checkpoint in ``step_N.tmp``, which it commits before the
        save hook runs. The staged directory is claimed first (``files.mark_unfinished``): if the run
        stops before the hook has finished, the committed ``step_N`` is recognised as unfinished, and
        the next run deletes it instead of resuming from it.
        """
        for staged in self.checkpoint_dir.glob("step_*.tmp"):
            if staged.is_dir():
                files.mark_unfinished(staged)
        state: dict[str, object] = self.module.state_dict()  # as fairseq2's own DDP facade: with _metadata
        return state

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        load_state_dict(self.module, state_dict)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float | None) -> Tensor:
        """Clip this rank's own gradient (its norm is not reduced over ranks)."""
        norm: Tensor = clip_grad_norm(self.module, max_norm)
        return norm

    def summon_full_parameters(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    # ------------------------------------------------------------ the trainer

    def attach(self, trainer: Trainer) -> None:
        """Write the consensus model and each rank's state into every checkpoint that ``trainer`` saves."""
        trainer.register_checkpoint_save_hook(self._on_checkpoint_saved)
        self.attached = True

    def close(self) -> None:
        """Release DDP's ``no_sync``, the hooks and the optimizer's exchange groups (idempotent).

        For use outside ``Trainer.run``: the trainer ends by destroying every process group, after
        its last checkpoint, whose hook waited for the exchange in flight.
        """
        self._hold_no_sync.close()
        self._step_hook.remove()
        self._load_hook.remove()
        self.optimizer.close()

    def _before_step(self, _optimizer: Optimizer, _args: Any, _kwargs: Any) -> None:
        if not self.attached:
            raise RuntimeError(
                f"{DECENTRALIZED_ADAM} needs its trainer hooks (per-rank checkpoints, local loss "
                "normalisation): build the trainer with decentadam.integrations.fairseq2.create_trainer("
                "context, unit, data_reader, ...) in place of context.create_trainer(...)."
            )
        if self.checkpoint_manager.is_saving:
            # The checkpoint of the previous step is still being written, and its save hook must see
            # that step's weights: let it finish (every rank is here: saves start at the same step).
            self.checkpoint_manager.maybe_complete_save_operation(blocking=True)

    def _on_checkpoint_saved(self, args: TrainStepHookArgs) -> None:
        """Every rank, once fairseq2 has written and committed the checkpoint of ``args.step_nr``."""
        step_dir = self.checkpoint_dir.joinpath(f"step_{args.step_nr}")
        model_files = sorted(step_dir.joinpath("model").rglob("*.pt"))
        opt = self.optimizer
        if len(model_files) != 1:
            raise RuntimeError(
                f"{DECENTRALIZED_ADAM}: expected one model file under {step_dir / 'model'}, found "
                f"{[str(f) for f in model_files]}; this fairseq2 version lays out checkpoints differently "
                "from the one decentadam supports (see docs/fairseq2.md)."
            )
        full_state = step_dir.joinpath("trainer").is_dir()  # not a model-only checkpoint
        error: Exception | None = None
        try:
            if full_state:
                files.state_dir(step_dir).mkdir(parents=True, exist_ok=True)
                own = {"model": self.module.state_dict(), "optimizer": opt.state_dict()}
                files.save_rank_state(step_dir, opt.rank, own)
        except Exception as caught:
            error = caught
        with averaged(self.module, opt):  # a collective; every rank's own weights come back after
            if opt.rank == 0 and error is None:
                try:
                    files.atomic_torch_save(self.module.state_dict(), model_files[0])
                except Exception as caught:
                    error = caught
        failed = _failed_ranks(opt, error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"{DECENTRALIZED_ADAM}: ranks {failed} could not write their part of checkpoint {step_dir} "
                "(their own errors say more)"
            )
        if full_state and opt.rank == 0:
            missing = files.missing_rank_files(step_dir, opt.world_size)
            if missing:
                raise RuntimeError(
                    f"{DECENTRALIZED_ADAM}: the state files of ranks {missing} are not in {step_dir}: every "
                    "rank must see the same checkpoint directory (a shared file system)."
                )
            # the completion marker, last: a resume trusts the per-rank files only once it is there
            shape = files.RunShape.of(opt, opt.world_size)
            files.write_meta(step_dir, shape, opt.step_count, {"fairseq2_step": args.step_nr})
            files.unmark_unfinished(step_dir)
        elif opt.rank == 0:  # a model-only checkpoint: complete once it holds the consensus
            shutil.rmtree(files.state_dir(step_dir), ignore_errors=True)
        _failed_ranks(opt, False)  # nobody reads the marker before rank 0 has written it

    def _after_load(self, _optimizer: Optimizer) -> None:
        """fairseq2 loaded the consensus weights and rank 0's optimizer state: take this rank's own back."""
        if self._restoring:
            return
        step = self.checkpoint_manager.maybe_get_last_step_number(exclude_model_only=True)
        if step is None:
            return
        step_dir = self.checkpoint_dir.joinpath(f"step_{step}")
        opt = self.optimizer
        if files.is_unfinished(step_dir):  # appeared after the optimizer's start discarded the others
            raise RuntimeError(
                f"{DECENTRALIZED_ADAM}: refusing to resume from {step_dir}: its save stopped before every "
                "rank's state was written, and its model file may be rank 0's own weights. Delete it (or "
                "run again: a new run deletes it at start) to resume from the last complete checkpoint."
            )
        if not files.is_checkpoint(step_dir):
            _warn(
                f"{step_dir} has no per-rank decentadam state: every rank resumes from the consensus "
                "weights and rank 0's optimizer state."
            )
            return
        meta = files.read_meta(step_dir)
        exact = files.check_resumable(
            meta,
            files.RunShape.of(opt, opt.world_size),
            step_dir,
            allow_topology_change=False,
            fix=f"Resume with optimizer.config.topology: {meta['topology']} and local_world_size: "
            f"{meta.get('local_world_size')}, or start a new run from the checkpoint's model "
            "(model.path) with a fresh output directory.",
        )
        if not exact:
            _warn(
                f"checkpoint {step_dir} was saved by {meta['world_size']} ranks and is resumed by "
                f"{opt.world_size}: every rank starts from the consensus (averaged) weights with rank 0's "
                "optimizer state."
            )
            return
        state = files.load_rank_state(step_dir, opt.rank)
        self.module.load_state_dict(state["model"])
        self._restoring = True
        try:
            opt.load_state_dict(state["optimizer"])
        finally:
            self._restoring = False
        logger.info("rank %d resumed its own weights and optimizer state from %s", opt.rank, step_dir)


def _failed_ranks(opt: DecentralizedAdam, failed: bool) -> list[int]:
    """The ranks that report a failure: a collective, so also a barrier."""
    if opt.world_size == 1:
        return [0] if failed else []
    flags = torch.zeros(opt.world_size, dtype=torch.float32, device=opt.device)
    flags[opt.rank] = float(failed)
    opt.communicator.world_sum(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)
    logger.warning(message)
