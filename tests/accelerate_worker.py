"""Run under ``accelerate launch`` by tests/test_accelerate.py; each rank saves what it observed.

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 \
        tests/accelerate_worker.py OUT_DIR SCENARIO[,SCENARIO...]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gossip import plain
from decentadam import A2CiD2, Comm, DecentralizedAdam
from decentadam import checkpoint_files as files
from decentadam.checkpoint import load_checkpoint, save_checkpoint
from decentadam.integrations.accelerate import log_metrics_every, prepare

ACCUM = 2
MAX_NORM = 0.05


class ListTracker(GeneralTracker):  # type: ignore[misc]
    """Keeps what accelerator.log sends, to check it."""

    name = "list"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict[str, float], int | None]] = []

    @property
    def tracker(self) -> Any:
        return self.logged

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    def log(self, values: dict[str, float], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((dict(values), step))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def make_loader(samples: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(samples, 8, generator=generator)
    targets = torch.randn(samples, 2, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=False)


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def loop(out: dict[str, Any]) -> None:
    """Gradient accumulation, clipping, scheduler, logging; profile the collectives of a window."""
    tracker = ListTracker()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, log_with=[tracker])
    accelerator.init_trackers("test")
    model = make_model()
    optimizer = DecentralizedAdam(
        model.parameters(),
        lr=1e-2,
        accum_steps=2,
        setting=plain("aer", second_moment="local"),
        comm=Comm(local_world_size=2),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1 + t))
    loader = make_loader(samples=4 * 4 * ACCUM * 8)  # 8 optimizer steps per rank
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler)
    log_metrics_every(accelerator, optimizer, every=4)  # steps 4 and 8: outside the profiled window
    inner = optimizer.optimizer
    reference = copy.deepcopy(model)  # single-process view of this rank's first optimizer step
    exchanges_after_micro_batch, norms, grads, reference_grad = [], [], [], None
    collectives: dict[str, int] = {}
    profiler = None
    for index, (inputs, targets) in enumerate(loader):
        if index == 4 * ACCUM:  # profile optimizer steps 5 to 7
            profiler = profile(activities=[ProfilerActivity.CPU])
            profiler.__enter__()
            exchanges_at_start = inner.stats.exchanges
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if index < ACCUM:
                ref_loss = nn.functional.mse_loss(reference(inputs), targets) / ACCUM
                ref_loss.backward()
            if accelerator.sync_gradients:
                grads.append(flat_grad(model).clone())
                if reference_grad is None:
                    reference_grad = flat_grad(reference)
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                out.setdefault("clipped_norms", []).append(float(flat_grad(model).norm()))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        exchanges_after_micro_batch.append(inner.stats.exchanges)
        if index == 7 * ACCUM - 1 and profiler is not None:
            inner.wait_for_exchanges()  # the last profiled exchange is still in flight
            profiler.__exit__(None, None, None)
            for event in profiler.events():
                if event.name.startswith("gloo:"):
                    collectives[event.name] = collectives.get(event.name, 0) + 1
            out["profiled_exchanges"] = inner.stats.exchanges - exchanges_at_start
    out.update(
        model_type=type(model).__name__,
        wrapped_by_ddp=isinstance(model, torch.nn.parallel.DistributedDataParallel),
        first_grad=grads[0],
        reference_grad=reference_grad,
        exchanges_after_micro_batch=exchanges_after_micro_batch,
        buckets=len(inner.buckets),
        norms=norms,
        collectives=collectives,
        step_count=inner.step_count,
        lr=scheduler.get_last_lr()[0],
        logged=[(sorted(values), step) for values, step in tracker.logged],
        num_processes=accelerator.num_processes,
    )


def fp16_skip(out: dict[str, Any]) -> None:
    """A loss scaler as on a GPU with fp16: rank 1 alone gets inf gradients at step 2."""
    accelerator = Accelerator()
    # Accelerate only builds a scaler for fp16 on accelerators; install the one it would build.
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = make_model()
    optimizer = DecentralizedAdam(model.parameters(), lr=1e-2, setting=plain("ring"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1 + t))
    loader = make_loader(samples=4 * 4 * 5)
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler)
    skipped, steps, scales, lrs = [], [], [], []
    for index, (inputs, targets) in enumerate(loader):
        loss = nn.functional.mse_loss(model(inputs), targets)
        if index == 2 and accelerator.process_index == 1:
            loss = loss * float("inf")
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(bool(optimizer.step_was_skipped))
        steps.append(optimizer.optimizer.step_count)
        scales.append(float(accelerator.scaler.get_scale()))
        lrs.append(scheduler.get_last_lr()[0])
    out.update(
        scaler_type=type(accelerator.scaler).__name__,
        skipped=skipped,
        steps=steps,
        scales=scales,
        lrs=lrs,
        finite=all(torch.isfinite(p).all().item() for p in model.parameters()),
    )


def fp16_resume(out: dict[str, Any], directory: Path) -> None:
    """Save half-way through an fp16 run whose first step overflowed, resume, compare."""

    def run(start: int, stop: int, load: bool) -> tuple[nn.Module, Any, list[tuple[bool, float]]]:
        accelerator = Accelerator()
        # Accelerate only builds a scaler for fp16 on accelerators; install the default GPU one.
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        model = make_model()
        optimizer = DecentralizedAdam(model.parameters(), lr=1e-2, setting=plain("ring"))
        loader = make_loader(samples=4 * 4 * 5)
        model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
        if load:
            assert load_checkpoint(directory / "ckpt", model, optimizer) == {"next": start}
        trace = []
        for index, (inputs, targets) in enumerate(loader):
            if not start <= index < stop:
                continue
            output = model(inputs)
            # plus an fp16 activation, as under autocast, whose gradient (the loss scale) overflows
            # fp16 at the initial scale 2**16 but not at 2**15
            loss = nn.functional.mse_loss(output, targets) + output.half().float().sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            trace.append((bool(optimizer.step_was_skipped), float(accelerator.scaler.get_scale())))
        return model, optimizer, trace

    model, optimizer, trace = run(0, 5, load=False)
    out.update(trace=trace, weights=flat_weights(model), step_count=optimizer.optimizer.step_count)
    model, optimizer, _ = run(0, 2, load=False)
    save_checkpoint(directory / "ckpt", model, optimizer, extra={"next": 2})
    model, optimizer, trace = run(2, 5, load=True)
    out.update(
        resumed_trace=trace,
        resumed_weights=flat_weights(model),
        resumed_step_count=optimizer.optimizer.step_count,
    )


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def consensus_weights(path: Path) -> torch.Tensor:
    """The model file that rank 0 writes: the average of the ranks' weights at the save."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / files.WEIGHTS_NAME))
    return torch.cat([tensors[name].reshape(-1) for name in make_model().state_dict()])


def backward_refusals(out: dict[str, Any]) -> None:
    """overlap="backward" cannot work with an fp16 loss scaler: prepare refuses it."""
    accelerator = Accelerator()
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = make_model()
    optimizer = DecentralizedAdam(
        model.parameters(), lr=1e-2, setting=plain("ring"), comm=Comm(overlap="backward")
    )
    try:
        prepare(accelerator, model, optimizer)
        out["fp16"] = "accepted"
    except ValueError as error:
        out["fp16"] = str(error)
    optimizer.remove_hooks()


def bf16(out: dict[str, Any]) -> None:
    """Accelerate's autocast applies to the prepared (unwrapped) model."""
    accelerator = Accelerator(mixed_precision="bf16")
    model = make_model()
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    optimizer = DecentralizedAdam(model.parameters(), lr=1e-2, setting=plain("one-peer-exp"))
    loader = make_loader(samples=4 * 4 * 3)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    losses = []
    for inputs, targets in loader:
        output = model(inputs)
        loss = nn.functional.mse_loss(output.float(), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    out.update(
        inner_dtypes=sorted({str(d) for d in seen}),
        output_dtype=str(output.dtype),
        param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        losses=losses,
        step_count=optimizer.optimizer.step_count,
    )


def a2cid2(out: dict[str, Any], directory: Path) -> None:
    """A2CiD2 through prepare: accumulation, scheduler, a local fp16 scaler, metrics, checkpoints."""
    tracker = ListTracker()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, log_with=[tracker])
    accelerator.init_trackers("test")
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what fp16 would install

    def build() -> tuple[nn.Module, A2CiD2]:
        model = make_model()
        local = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        return model, A2CiD2(local, graph="ring", schedule="deterministic", timeout=30)

    model, optimizer = build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1 + t))
    loader = make_loader(samples=4 * 4 * ACCUM * 6)  # 6 optimizer steps per rank
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler)
    log_metrics_every(accelerator, optimizer, every=3)
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    inner = optimizer.optimizer
    # Paused around the save, this rank's weights cannot change between reading them here and the
    # save writing them; whether the ranks still differ then depends on timing (a ring of 4 can
    # reach the exact average in two rounds of averagings after the last step), so the test
    # compares each rank file with its own rank's weights instead.
    with inner.paused():
        own_weights = flat_weights(model)
        save_checkpoint(directory / "a2cid2", model, optimizer, scheduler=scheduler, extra={"steps": 6})
    rank = accelerator.process_index
    saved = files.load_rank_state(directory / "a2cid2", rank)

    fresh_model, fresh = build()
    fresh_model, fresh = prepare(accelerator, fresh_model, fresh)
    load_checkpoint(directory / "a2cid2", fresh_model, fresh)
    reloaded = fresh.optimizer
    out.update(
        wrapped_by_ddp=isinstance(model, torch.nn.parallel.DistributedDataParallel),
        scaler_type=type(accelerator.scaler).__name__,
        step_count=inner.step_count,
        lr=scheduler.get_last_lr()[0],
        logged=[(sorted(values), step) for values, step in tracker.logged],
        meta=files.read_meta(directory / "a2cid2"),
        own_weights=own_weights,
        saved_weights=torch.cat([t.reshape(-1) for t in saved["model"].values()]),
        consensus_weights=consensus_weights(directory / "a2cid2"),
        reloaded_weights=flat_weights(fresh_model),
        saved_offsets=saved["optimizer"]["a2cid2"]["x_tilde_minus_x"],
        reloaded_offsets=reloaded.state_dict()["a2cid2"]["x_tilde_minus_x"],
        reloaded_step_count=reloaded.step_count,
    )
    inner.close()  # every rank leaves with the exact average
    out["final_weights"] = flat_weights(model)
    reloaded.close()


def main() -> None:
    directory, scenarios = Path(sys.argv[1]), sys.argv[2].split(",")
    results: dict[str, Any] = {}
    for name in scenarios:
        results[name] = {}
        if name == "fp16_resume":
            fp16_resume(results[name], directory)
            continue
        if name == "a2cid2":
            a2cid2(results[name], directory)
            continue
        {"loop": loop, "fp16": fp16_skip, "bf16": bf16, "backward": backward_refusals}[name](results[name])
    rank = torch.distributed.get_rank()
    torch.save(results, directory / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
