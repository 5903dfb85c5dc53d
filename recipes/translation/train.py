"""Train a Transformer translation model with All-Reduce or decentralized AccumAdam (``decentadam``).

Run it as a module from the repository root. Multi30k English->German on a CPU-only machine, 4
processes emulating 2 nodes x 2 (gloo)::

    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 4 \\
        --num_machines 1 --mixed_precision no --dynamo_backend no \\
        -m recipes.translation.train --preset multi30k-en-de --optimizer decentralized \\
        data=DATA/multi30k train.output_dir=runs/m30k-aer

    python -m eval.bleu runs/m30k-aer --average-last 1 --data DATA/multi30k \\
        --split test_2016_flickr --src en --tgt de

The baseline is the same command with ``--optimizer allreduce`` (AdamW under Accelerate's DDP).
WMT14 Transformer-base, 2 nodes x 8 GPUs in bf16 (on each node, with its ``--machine_rank``)::

    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \\
        --main_process_ip HOST --main_process_port 29500 --mixed_precision bf16 \\
        -m recipes.translation.train --preset wmt14-en-de-base --optimizer decentralized

One process is ``python -m recipes.translation.train --preset multi30k-en-de data=DIR``; with
``--optimizer decentralized`` it is plain (Accum)Adam, nothing to average with, and says so once.

The configuration is a preset (``presets/NAME.toml`` or a path) with ``section.key=value``
overrides (see ``config.py``); the effective one is written to ``OUTPUT_DIR/config.toml``.
``--resume`` continues the run in ``train.output_dir`` from its last checkpoint exactly (same number
of processes): weights, optimizer and scheduler states, RNG and the position in the data order.
``--resume auto`` does that when there is a checkpoint and starts a new run when there is none, so a
launcher can restart a failed run unattended (``torchrun --max-restarts=3``, ``accelerate launch
--max_restarts 3``; docs/checkpoints.md); ``train.timeout_s`` bounds how long the other ranks wait
for one that stalled.
The run directory (``recipes/common/run.py``) gets ``metrics.jsonl`` (one line per evaluation),
TensorBoard events under ``tb/`` and checkpoints ``step-N/`` that ``from_pretrained`` loads (the
consensus model for decentralized runs) with their tokenizer. The parts that differ from a plain
Accelerate loop are marked ``# decentadam``.
"""

from __future__ import annotations

if not __package__:  # run as a file, `recipes` would not be importable
    raise SystemExit(
        f"{__file__} is a module of the recipes package: "
        "run python -m recipes.translation.train (from the repository root, or anywhere once installed)"
    )

import contextlib
import dataclasses
import math
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recipes.common import cli
from recipes.common.config import ConfigError, check_choice, check_positive
from recipes.common.loop import (
    Parallel,
    TrainingClock,
    consensus,
    finish,
    log_step,
    mixed_precision,
    one_process_note,
    out_of_time,
)
from recipes.common.optim import build_optimizer, resolved
from recipes.common.progress import LOG_FORMATS, Progress, logger, showing_bars
from recipes.common.run import RunDirectory
from recipes.common.trackers import PROJECT, check_report_to, tracker_config, trackers, where_logs_are
from recipes.translation import config, data
from recipes.translation.model import build_model, loss_and_tokens

if TYPE_CHECKING:
    from decentadam import DecentralizedAdam

OPTIMIZERS = ("allreduce", "decentralized")


def check(cfg: config.Config) -> None:
    """Values that the dataclass types do not rule out; raises ConfigError before anything starts.
    ``cfg.optim`` becomes the resolved one (:func:`recipes.common.optim.resolved`)."""
    check_choice("optim.optimizer", cfg.optim.optimizer, OPTIMIZERS)
    cfg.optim = resolved(
        cfg.optim
    )  # DecentralizedAdam's options as its setting holds them: the run keeps them
    mixed_precision(cfg.train.mixed_precision)  # raises for an unknown setting
    check_choice("train.log_format", cfg.train.log_format, LOG_FORMATS)
    check_report_to(cfg.train.report_to)  # an unknown or uninstalled tracker fails here
    if not cfg.data.path:
        raise ConfigError("data.path is empty: give the data directory (data=DIR) or a hub name (wmt/wmt14)")
    if cfg.data.path in data.HUB_PAIRS:
        data.hub_config(cfg.data.path, cfg.data.src, cfg.data.tgt)  # an unknown pair fails here
    names = ("global_tokens", "grad_accum", "max_steps", "log_every", "eval_every", "save_every")
    check_positive(cfg.train, "train", names)
    check_positive(cfg.train, "train", ("keep_last", "timeout_s"), zero=True)


def main(
    argv: list[str] | None = None,
    optimizer_class: type[DecentralizedAdam] | None = None,
    parallel: Parallel | None = None,
) -> None:
    """Train as the module docstring says; ``optimizer_class`` replaces DecentralizedAdam (a subclass);
    ``parallel`` runs another data-parallel method with ``--optimizer allreduce``'s AdamW
    (:class:`recipes.common.loop.Parallel`)."""
    args, cfg = cli.parse("recipes.translation.train", __doc__ or "", config.PRESETS, OPTIMIZERS, argv)
    check(cfg)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed

    from decentadam.checkpoint import load_checkpoint
    from decentadam.distributed import init_restartable_process_group
    from decentadam.integrations.accelerate import prepare

    d, o, t = cfg.data, cfg.optim, cfg.train
    decentralized = o.optimizer == "decentralized"
    timeout = [InitProcessGroupKwargs(timeout=timedelta(seconds=t.timeout_s))] if t.timeout_s else []
    init_restartable_process_group(t.timeout_s)  # under torchrun --max-restarts: each attempt its own keys
    log_with, init_kwargs = trackers(t.report_to, Path(t.output_dir))
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=mixed_precision(t.mixed_precision),
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=t.output_dir, logging_dir=f"{t.output_dir}/tb"),
        kwargs_handlers=timeout,
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    run = RunDirectory(Path(t.output_dir), accelerator)
    resume_from = run.resume_from(args.resume)

    # 1. Data: the main process trains the tokenizer on a sample of the training split and encodes the
    # splits into token caches on disk; then each node's first rank, then the others, find them there
    # and memory-map them (a cache in a node-local directory is built once per node).
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        tokenizer, tokenizer_dir, train_set, val_set = data.prepare_data(
            d, progress=accelerator.is_main_process and showing_bars(t.log_format)
        )
    pad_id = tokenizer.pad_token_id
    max_tokens = t.global_tokens // (world * t.grad_accum)
    train_batches = data.TokenBatches(
        train_set.src_lengths, train_set.tgt_lengths, max_tokens,
        seed=t.seed, rank=rank, world_size=world, multiple_of=t.grad_accum,
    )  # fmt: skip
    val_batches = data.TokenBatches(
        val_set.src_lengths, val_set.tgt_lengths, t.val_tokens, rank=rank, world_size=world, shuffle=False
    ).epoch_batches(0)
    run.write_config(config.dump(cfg))
    accelerator.print(
        f"{len(train_set)} training pairs, {len(tokenizer)} tokens ({tokenizer_dir}), {world} processes x "
        f"{max_tokens} tokens x {t.grad_accum} micro-batches per step, {o.optimizer}"
    )

    # 2. Model and optimizer: identical initial weights on every rank, then per-rank dropout streams.
    set_seed(t.seed)
    model = build_model(
        len(tokenizer), pad_id=pad_id, eos_id=tokenizer.eos_token_id, **dataclasses.asdict(cfg.model)
    ).to(accelerator.device)
    set_seed(t.seed + 1000 * (rank + 1))
    optimizer: Any = build_optimizer(  # decentadam: DecentralizedAdam, or AdamW for the baseline
        model, o, world_size=world, timeout=t.timeout_s or None, optimizer_class=optimizer_class
    )
    warmup = max(o.warmup_steps, 1)
    # Not prepared: Accelerate's scheduler wrapper would step it once per process and step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))
    )
    if decentralized:
        model, optimizer = prepare(accelerator, model, optimizer)  # decentadam: no DDP wrapper
    elif parallel is not None:  # another data-parallel method: its model and optimizer wrappers
        model, optimizer = parallel.prepare(accelerator, model, optimizer, scheduler)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    mean = parallel.averaged if parallel is not None else contextlib.nullcontext  # ranks' mean model

    step = epoch = start_batch = 0
    clock = TrainingClock()
    if resume_from is not None:
        extra = load_checkpoint(resume_from, model, optimizer, scheduler=scheduler)  # decentadam: both
        step, epoch, start_batch = int(extra["step"]), int(extra["epoch"]), int(extra["batch"])
        clock = TrainingClock(float(extra["train_seconds"]))
        accelerator.print(f"resumed from {resume_from} at step {step} (epoch {epoch}, batch {start_batch})")
    run.keep_metrics_until(step)  # a restart redoes the steps after the checkpoint
    accelerator.init_trackers(PROJECT, tracker_config(cfg, world_size=world), init_kwargs)

    def evaluate() -> float:
        """Validation NLL per target token, of the consensus model (the exact average over ranks)."""
        totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        with mean(model), consensus(model, optimizer, decentralized):  # decentadam: the exact average
            for _, batch in data.iterate(val_set, val_batches, pad_id):
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                _, nll, tokens = loss_and_tokens(model, batch, 0.0)
                totals += torch.stack([nll.double(), tokens.double()])
        totals = accelerator.reduce(totals, reduction="sum")
        return float(totals[0] / totals[1])

    def save() -> None:
        extra = {"step": step, "epoch": epoch, "batch": start_batch, "train_seconds": clock.seconds}
        with mean(model) as saved:
            run.save(  # decentadam: the consensus model, every rank's state, the tokenizer; atomic
                step, saved, optimizer, scheduler=scheduler, extra=extra, processor=run.saving(tokenizer),
                keep_last=t.keep_last,
            )  # fmt: skip

    # 3. Training: one optimizer step per grad_accum micro-batches; log, evaluate and save on the way
    # (off the training clock).
    progress = Progress(t.log_format, t.max_steps, step, main=accelerator.is_main_process)
    if note := one_process_note("recipes.translation.train", o, world):  # decentadam: nothing to average
        progress.write(note)
    progress.write(where_logs_are(t.report_to, run.path))
    # Loss sum, micro-batches, target tokens since the last log, summed on the device: read (a host-device
    # sync) only at log steps. The float64 sums of the same float32 losses give the numbers of a host sum.
    window = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    one = torch.ones((), dtype=torch.float64, device=accelerator.device)
    window_start = clock.seconds
    logged = [0.0, 0.0]  # loss sum and micro-batches of the logged windows since the last evaluation
    since = None  # decentadam: communication counters at the last log
    stop = step >= t.max_steps
    first_step = step + 1
    model.train()
    clock.start()
    while not stop:
        batches = train_batches.epoch_batches(epoch)
        micro: list[dict[str, torch.Tensor]] = []
        for batch_index, batch in data.iterate(train_set, batches, pad_id, start=start_batch):
            micro.append(batch)
            if len(micro) < t.grad_accum:
                continue
            for position, micro_batch in enumerate(micro):
                micro_batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in micro_batch.items()}
                last = position == len(micro) - 1
                # DDP all-reduces gradients on the last micro-batch only; decentralized never does.
                with contextlib.nullcontext() if last or decentralized else accelerator.no_sync(model):
                    loss, _, tokens = loss_and_tokens(model, micro_batch, o.label_smoothing)
                    accelerator.backward(loss / len(micro))
                window += torch.stack((loss.detach().double(), one, tokens.double()))
            micro.clear()
            if o.clip_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), o.clip_norm)  # this rank's gradient
            optimizer.step()  # decentralized: mix in the neighbours, local step, start the next exchange
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            clock.stop()
            step, start_batch = step + 1, batch_index + 1
            progress.update(1)
            stop = step >= t.max_steps
            if step == first_step:  # once per rank: what starting took (data preparation, mostly)
                logger.info(f"rank {rank}: {first_step_report()}", extra={"values": {"rank": rank}})

            if step % t.log_every == 0 or stop:
                totals = accelerator.reduce(window, reduction="sum").cpu()
                logged = [logged[0] + float(totals[0]), logged[1] + float(totals[1])]
                values = {
                    "train/loss": float(totals[0] / totals[1]),
                    "train/tokens_per_s": float(totals[2]) / max(clock.seconds - window_start, 1e-9),
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/seconds": clock.seconds,
                }
                postfix = {
                    "loss": f"{values['train/loss']:.3f}",
                    "tok/s": f"{values['train/tokens_per_s']:.0f}",
                }
                since = log_step(  # decentadam: consensus distance and communication wait, a collective
                    accelerator, progress, step, values, postfix, optimizer if decentralized else None, since
                )
                window.zero_()
                window_start = clock.seconds
                stop = stop or out_of_time(accelerator, clock.seconds, t.max_minutes)
            if step % t.eval_every == 0 or stop:
                val_nll = evaluate()
                accelerator.log({"valid/nll": val_nll, "valid/ppl": math.exp(val_nll)}, step=step)
                progress.write(
                    f"step {step}  valid nll {val_nll:.4f}  ({clock.seconds:.0f} s of training)",
                    step=step, **{"valid/nll": val_nll, "train/seconds": clock.seconds},
                )  # fmt: skip
                record = {"step": step, "train_seconds": clock.seconds, "valid_nll": val_nll, "epoch": epoch}
                if logged[1] > 0:  # the training loss (label-smoothed, as optimized) since the last one
                    record["train_loss"] = logged[0] / logged[1]
                run.record(record)
                logged = [0.0, 0.0]
            if step % t.save_every == 0 or stop:
                save()
            if stop:
                break
            clock.start()
        else:
            epoch, start_batch = epoch + 1, 0
    # decentadam: the last exchange finishes and the exchange groups are released
    finish(accelerator, progress, optimizer if decentralized else None, step, clock.seconds, run.path)


def first_step_report() -> str:
    """Seconds since this process started and its peak resident memory so far (VmHWM)."""
    import psutil  # a dependency of accelerate

    process = psutil.Process()
    seconds = time.time() - process.create_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return f"first optimizer step {seconds:.1f} s after the process started, peak RSS {peak / 2**30:.2f} GiB"


def run(argv: list[str] | None = None) -> None:
    """The command line (``python -m recipes.translation.train``, ``decentadam-train translation``): bad
    configuration or data is one line and exit code 2."""
    cli.exit_on_bad_input(lambda: main(argv), (ConfigError, data.DataError))


if __name__ == "__main__":
    run()
