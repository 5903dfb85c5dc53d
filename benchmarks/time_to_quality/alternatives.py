"""What a user on a slow network would pick instead of DecentralizedAdam, run by the translation
recipe's own loop (:class:`recipes.common.loop.Parallel`), one process per rank::

    python -m benchmarks.time_to_quality.alternatives powersgd --warmup 300 \\
        --preset multi30k-en-de --optimizer allreduce data=DIR ...

The first argument names the method, the options before the recipe's are the method's, and the
rest goes to ``recipes.translation.train`` unchanged (``--optimizer allreduce``: the recipe builds
its AdamW with the preset's learning rate, betas, eps and weight decay; every method starts from its
initial weights and reads its data order).

``allreduce-bf16``
    DDP + AdamW with torch's ``bf16_compress_hook``: each gradient bucket is cast to bfloat16,
    divided by the world size and all-reduced, then cast back (half the bytes). DDP's
    ``register_comm_hook`` refuses that function by its name unless CUDA and NCCL are present, but
    gloo all-reduces bfloat16 (tests/test_time_to_quality_alternatives.py checks it), so the hook
    registered here is a one-line function that calls torch's ``bf16_compress_hook`` unchanged.
``powersgd``
    DDP + AdamW with torch's ``powerSGD_hook`` (``matrix_approximation_rank`` 4, error feedback and
    warm start on, torch's defaults), plain all-reduce for the first ``start_powerSGD_iter`` =
    ``--warmup`` steps, the learning rate's warm-up, as torch recommends (the compression error is
    largest early). After that every rank's AdamW sees the same low-rank approximation of the mean
    gradient, plus the error it left out at the last step (error feedback): Adam's moments are
    those of the approximated gradient, so its second moment sees less of the gradient's noise
    than with the exact mean. Tensors whose compression would not save 2x go through a plain
    all-reduce (``min_compression_rate``, torch's default). Once compressing, each bucket's hook
    waits for its own three all-reduces before it returns (:func:`powersgd_hook`): on gloo, torch's
    hook issues the second and third from callbacks on gloo's threads, so with several buckets the
    ranks could issue them in different orders (a collective mismatch that aborts the run).
``postlocal``
    torch's post-local SGD: ``PostLocalSGDOptimizer`` around the recipe's AdamW with a
    ``PeriodicModelAverager(period=4, warmup_steps=--warmup)``, and DDP's ``post_localSGD_hook``
    with ``start_localSGD_iter=--warmup`` and the node's ranks as its subgroup, as torch documents
    it: during the warm-up every step all-reduces the gradients over all ranks; after it the ranks
    of a node all-reduce their gradients every step (no bytes across nodes) and every ``--period``
    steps all ranks average their parameters. Each rank's AdamW keeps its own moments.
``decent-dp``
    the seed authors' package (``decent_dp`` 0.2.3, the ``bench`` extra): its
    ``DecentralizedDataParallel`` on ``alternating-exp-ring`` (AER) with its AccumAdamW
    (``optim_fn_accum_adamw``, the window of this library's ``accumadam`` setting), the recipe's
    learning rate, AdamW's betas, eps and weight decay, and the recipe's schedule (one scheduler per
    bucket, as the package builds them). It updates from backward hooks, so the loop's
    ``optimizer.step()`` is empty; between micro-batches ``accelerator.no_sync`` switches its
    gradient accumulation on.

Evaluations and checkpoints of ``postlocal`` and ``decent-dp`` are of the ranks' mean model
(``averaged``), as the recipe's are for DecentralizedAdam; the hooks' ranks hold equal weights.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket

from decentadam.options import SETTINGS, Local

if TYPE_CHECKING:
    from accelerate import Accelerator

    from recipes.common.loop import Parallel

POWERSGD_RANK = 4
"""PowerSGD's ``matrix_approximation_rank``."""
PERIOD = 4
"""Post-local SGD's ``PeriodicModelAverager`` period: the steps between two averages over all ranks."""
DECENT_DP_TOPOLOGY = "alternating-exp-ring"
"""decent-dp's name of AER."""
_ACCUMADAM = SETTINGS["accumadam"].second_moment
DECENT_DP_WINDOW = _ACCUMADAM.accum_steps if isinstance(_ACCUMADAM, Local) else 4
"""decent-dp AccumAdamW's ``accum_iter``: the window of this library's ``accumadam`` setting."""


@contextlib.contextmanager
def ranks_mean(module: nn.Module) -> Iterator[nn.Module]:
    """Inside the block ``module``'s parameters hold their mean over all ranks (a collective); each
    rank's own values come back on exit."""
    params = [p for p in module.parameters()]
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            if world > 1:
                dist.all_reduce(p.data)
                p.data.div_(world)
    try:
        yield module
    finally:
        with torch.no_grad():
            for p, own in zip(params, saved, strict=True):
                p.copy_(own)


def bf16_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook``, unchanged, under a name DDP's CUDA-only check lets through."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def powersgd_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook``; once it compresses, finished before the next bucket's hook starts.

    Compressing a bucket takes three all-reduces (the uncompressed tensors, then ``P``, then ``Q``),
    the later two issued from the earlier one's future. On gloo (CPU) those futures complete on
    gloo's threads, so while backward goes on, one rank can issue bucket ``k``'s ``P`` before bucket
    ``k + 1``'s first all-reduce and another after it: a collective mismatch (gloo aborts with
    "Received data size doesn't match expected size"). Waiting here keeps every rank's order the
    buckets' order; the compressed messages are small, so what it costs is their latency.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    compressing = state.iter >= state.start_powerSGD_iter
    future = powerSGD_hook(state, bucket)
    if not compressing:
        return future  # one plain all-reduce per bucket, issued in the buckets' order
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(future.wait())
    return done


# DDP compares a hook's annotations with these classes, and this module's annotations are strings
for _hook in (bf16_hook, powersgd_hook):
    _hook.__annotations__ = {"state": Any, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}


@dataclass(frozen=True)
class CommHook:
    """DDP + AdamW with a communication hook (``allreduce-bf16``, ``powersgd``)."""

    kind: str
    warmup: int = 0
    rank: int = POWERSGD_RANK

    def prepare(
        self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        model, optimizer = accelerator.prepare(model, optimizer)
        ddp = _ddp(model)
        if self.kind == "bf16":
            ddp.register_comm_hook(None, bf16_hook)
        else:
            state = powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.rank,
                start_powerSGD_iter=max(self.warmup, 2),  # torch needs >= 2 with error feedback
            )
            ddp.register_comm_hook(state, powersgd_hook)
        return model, optimizer

    def averaged(self, model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        return contextlib.nullcontext(model)  # every rank applies the same all-reduced gradient


@dataclass(frozen=True)
class PostLocal:
    """Post-local SGD around the recipe's AdamW (``postlocal``)."""

    warmup: int
    period: int = PERIOD

    def prepare(
        self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        model, optimizer = accelerator.prepare(model, optimizer)
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes = [list(range(start, start + local)) for start in range(0, world, local)]
        subgroup, _ = dist.new_subgroups_by_enumeration(nodes)  # type: ignore[no-untyped-call]
        state = PostLocalSGDState(  # type: ignore[no-untyped-call]
            process_group=None, subgroup=subgroup, start_localSGD_iter=self.warmup
        )
        _ddp(model).register_comm_hook(state, post_localSGD_hook)
        averager = PeriodicModelAverager(period=self.period, warmup_steps=self.warmup)
        return model, PostLocalSGDOptimizer(optim=optimizer, averager=averager)

    def averaged(self, model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        return ranks_mean(_ddp(model).module)


class _InHooks(torch.optim.Optimizer):
    """What the loop steps for decent-dp: nothing, its hooks step inside backward (and its first
    update needs the first step's gradients until the next forward: ``zero_grad`` leaves them)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


@dataclass(frozen=True)
class DecentDP:
    """decent-dp's DecentralizedDataParallel with its AccumAdamW (``decent-dp``)."""

    topology: str = DECENT_DP_TOPOLOGY
    window: int = DECENT_DP_WINDOW

    def prepare(
        self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        from decent_dp.ddp import DecentralizedDataParallel
        from decent_dp.optim import optim_fn_accum_adamw

        defaults = optimizer.defaults  # the recipe's AdamW: its rate, betas, eps, weight decay
        decays = [g["weight_decay"] for g in optimizer.param_groups if g["weight_decay"]]
        beta1, beta2 = defaults["betas"]
        optim_fn = partial(
            optim_fn_accum_adamw, lr=defaults["lr"], beta1=beta1, beta2=beta2, eps=defaults["eps"],
            weight_decay=decays[0] if decays else 0.0, accum_iter=self.window,
        )  # fmt: skip
        schedule = scheduler.lr_lambdas[0]  # the recipe's LambdaLR: its warm-up and decay

        class WithNoSync(DecentralizedDataParallel):  # type: ignore[misc]
            @contextlib.contextmanager
            def no_sync(self) -> Iterator[None]:  # accelerator.no_sync: micro-batches accumulate
                self.set_accumulate_grad(True)
                try:
                    yield
                finally:
                    self.set_accumulate_grad(False)

        wrapped = WithNoSync(
            model.to(accelerator.device),
            optim_fn=optim_fn,
            lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            topology=self.topology,
            _local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        )
        return wrapped, _InHooks(model.parameters())

    def averaged(self, model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        inner = model._model  # decent-dp's wrapper holds the user's module there
        assert isinstance(inner, nn.Module)
        return ranks_mean(inner)


def _ddp(model: nn.Module) -> torch.nn.parallel.DistributedDataParallel:
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(
            f"the communication hooks need DDP, but the model is a {type(model).__name__}: launch more "
            "than one process (WORLD_SIZE > 1)"
        )
    return model


BUILDERS: dict[str, Callable[[argparse.Namespace], Parallel]] = {
    "allreduce-bf16": lambda a: CommHook("bf16"),
    "powersgd": lambda a: CommHook("powersgd", warmup=a.warmup, rank=a.powersgd_rank),
    "postlocal": lambda a: PostLocal(a.warmup, period=a.period),
    "decent-dp": lambda a: DecentDP(),
}
"""Each method's :class:`~recipes.common.loop.Parallel` from this module's options."""


def parse(argv: Sequence[str]) -> tuple[Parallel, list[str]]:
    """The method of ``argv`` and the recipe's arguments (the rest)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_quality.alternatives")
    parser.add_argument("method", choices=sorted(BUILDERS))
    parser.add_argument("--warmup", type=int, default=0, help="steps before compression / local steps")
    parser.add_argument("--powersgd-rank", type=int, default=POWERSGD_RANK)
    parser.add_argument("--period", type=int, default=PERIOD, help="post-local SGD's averaging period")
    args, recipe = parser.parse_known_args(argv)
    if args.warmup < 0 or args.powersgd_rank < 1 or args.period < 1:
        parser.error("--warmup must be >= 0, --powersgd-rank and --period >= 1")
    return BUILDERS[args.method](args), recipe


def main(argv: Sequence[str] | None = None) -> None:
    from recipes.common import cli
    from recipes.common.config import ConfigError
    from recipes.translation import data, train

    parallel, recipe = parse(sys.argv[1:] if argv is None else argv)
    cli.exit_on_bad_input(partial(train.main, recipe, parallel=parallel), (ConfigError, data.DataError))


if __name__ == "__main__":
    main()
