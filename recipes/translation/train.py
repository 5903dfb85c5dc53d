"""Train a Transformer translation model with All-Reduce or decentralized AccumAdam (``decentadam``).

Multi30k English->German on a CPU-only machine, 4 processes emulating 2 nodes x 2 (gloo)::

    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 4 \\
        --num_machines 1 --mixed_precision no --dynamo_backend no \\
        recipes/translation/train.py --preset multi30k-en-de --optimizer decentralized \\
        data=../shared/data/multi30k train.output_dir=runs/m30k-aer

    python eval/bleu.py runs/m30k-aer --average-last 1 --data ../shared/data/multi30k \\
        --split test_2016_flickr --src en --tgt de

The baseline is the same command with ``--optimizer allreduce`` (AdamW under Accelerate's DDP).
WMT14 Transformer-base, 2 nodes x 8 GPUs in bf16 (on each node, with its ``--machine_rank``)::

    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \\
        --main_process_ip HOST --main_process_port 29500 --mixed_precision bf16 \\
        recipes/translation/train.py --preset wmt14-en-de-base --optimizer decentralized

One process is ``python recipes/translation/train.py --preset multi30k-en-de data=DIR``.

The configuration is a preset (``presets/NAME.toml`` or a path) with ``section.key=value``
overrides (see ``config.py``); the effective one is written to ``OUTPUT_DIR/config.toml``.
``--resume`` continues the run in ``train.output_dir`` from its last checkpoint exactly (same number
of processes): weights, optimizer and scheduler states, RNG and the position in the data order.
The run directory gets ``metrics.jsonl`` (one line per evaluation), TensorBoard events under
``tb/`` and checkpoints ``step-N/`` that ``from_pretrained`` loads (the consensus model for
decentralized runs) with their tokenizer. The parts that differ from a plain Accelerate loop are
marked ``# decentadam``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import checkpoints
import config
import data
import torch
from model import build_model, loss_and_tokens

OPTIMIZERS = ("allreduce", "decentralized")
PRECISIONS = ("auto", "no", "bf16", "fp16")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, config.Config]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", required=True, help=f"one of {', '.join(config.available_presets())}, or a .toml"
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the preset's optim.optimizer")
    parser.add_argument("--topology", help="decentralized graph (optim.topology)")
    parser.add_argument("--accum-steps", type=int, help="AccumAdam window s (optim.accum_steps)")
    parser.add_argument(
        "--local-world-size", type=int, help="ranks per node for aer (optim.local_world_size)"
    )
    parser.add_argument("--output-dir", help="run directory (train.output_dir)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run directory's last checkpoint"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.max_steps=200 data=DIR")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after flags
    flags = {
        "optim.optimizer": args.optimizer,
        "optim.topology": args.topology,
        "optim.accum_steps": args.accum_steps,
        "optim.local_world_size": args.local_world_size,
        "train.output_dir": args.output_dir,
    }
    overrides = list(args.overrides) + [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    cfg = config.load(args.preset, overrides)
    check(cfg)
    return args, cfg


def check(cfg: config.Config) -> None:
    """Values that the dataclass types do not rule out; raises ConfigError before anything starts."""
    if cfg.optim.optimizer not in OPTIMIZERS:
        raise config.ConfigError(
            f"optim.optimizer = {cfg.optim.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}"
        )
    if cfg.train.mixed_precision not in PRECISIONS:
        raise config.ConfigError(
            f"train.mixed_precision = {cfg.train.mixed_precision!r}: expected one of {', '.join(PRECISIONS)}"
        )
    if not cfg.data.path:
        raise config.ConfigError(
            "data.path is empty: give the data directory (data=DIR) or a hub name (wmt/wmt14)"
        )
    if cfg.data.path in data.HUB_PAIRS:
        data.hub_config(cfg.data.path, cfg.data.src, cfg.data.tgt)  # an unknown pair fails here
    for name in ("global_tokens", "grad_accum", "max_steps", "log_every", "eval_every", "save_every"):
        if getattr(cfg.train, name) < 1:
            raise config.ConfigError(
                f"train.{name} = {getattr(cfg.train, name)}: expected a positive integer"
            )


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from decentadam import DecentralizedAdam
    from decentadam.checkpoint import load_checkpoint, save_checkpoint
    from decentadam.consensus import averaged, metrics
    from decentadam.integrations.accelerate import prepare

    run = Path(cfg.train.output_dir)
    decentralized = cfg.optim.optimizer == "decentralized"
    precision = cfg.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=precision,
        log_with="tensorboard",
        project_dir=str(run),
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    previous = checkpoints.list_checkpoints(run)
    if previous and not args.resume:
        raise config.ConfigError(
            f"{run} already holds checkpoints ({previous[-1].name}); pass --resume or another output_dir"
        )
    if args.resume and not previous:
        raise config.ConfigError(f"--resume: {run} holds no checkpoint to resume from")

    # 1. Data: read and check every split first, then the tokenizer (trained once, by the main process).
    train_text = data.read_split(
        cfg.data.path, cfg.data.train_split, cfg.data.src, cfg.data.tgt, cfg.data.limit
    )
    valid_text = data.read_split(
        cfg.data.path, cfg.data.valid_split, cfg.data.src, cfg.data.tgt, cfg.data.valid_limit
    )
    cache = cfg.data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "decentadam", "translation")
    with accelerator.main_process_first():
        tokenizer, tokenizer_dir = data.build_tokenizer(
            list(train_text), cfg.data.vocab_size, cache, path=cfg.data.tokenizer
        )
    pad_id = tokenizer.pad_token_id
    train_set = data.encode(tokenizer, *train_text, max_length=cfg.data.max_length)
    valid_set = data.encode(tokenizer, *valid_text)
    max_tokens = cfg.train.global_tokens // (world * cfg.train.grad_accum)
    train_batches = data.TokenBatches(
        train_set.src_lengths,
        train_set.tgt_lengths,
        max_tokens,
        seed=cfg.train.seed,
        rank=rank,
        world_size=world,
        multiple_of=cfg.train.grad_accum,
    )
    valid_batches = data.TokenBatches(
        valid_set.src_lengths,
        valid_set.tgt_lengths,
        cfg.train.valid_tokens,
        rank=rank,
        world_size=world,
        shuffle=False,
    ).epoch_batches(0)
    if accelerator.is_main_process:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.toml").write_text(config.dump(cfg))
    accelerator.print(
        f"{len(train_set)} training pairs, {len(tokenizer)} tokens ({tokenizer_dir}), {world} processes x "
        f"{max_tokens} tokens x {cfg.train.grad_accum} micro-batches per step, {cfg.optim.optimizer}"
    )

    # 2. Model and optimizer: identical initial weights on every rank, then per-rank dropout streams.
    set_seed(cfg.train.seed)
    model = build_model(
        len(tokenizer), pad_id=pad_id, eos_id=tokenizer.eos_token_id, **dataclasses.asdict(cfg.model)
    ).to(accelerator.device)
    set_seed(cfg.train.seed + 1000 * (rank + 1))
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n]
    decay = [p for n, p in model.named_parameters() if not (p.ndim < 2 or "norm" in n)]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    o = cfg.optim
    optimizer: Any
    if decentralized:
        optimizer = DecentralizedAdam(  # decentadam
            groups,
            lr=o.lr,
            betas=o.betas_decentralized,
            eps=o.eps,
            weight_decay=o.weight_decay,
            accum_steps=o.accum_steps,
            topology=o.topology,
            local_world_size=min(o.local_world_size, world) if o.local_world_size else None,
        )
    else:
        optimizer = torch.optim.AdamW(
            groups, lr=o.lr, betas=o.betas_allreduce, eps=o.eps, weight_decay=o.weight_decay
        )
    warmup = max(o.warmup_steps, 1)
    # Not prepared: Accelerate's scheduler wrapper would step it once per process and step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: min((t + 1) / warmup, math.sqrt(warmup / (t + 1)))
    )
    if decentralized:
        model, optimizer = prepare(accelerator, model, optimizer)  # decentadam: no DDP wrapper
    else:
        model, optimizer = accelerator.prepare(model, optimizer)

    step = epoch = start_batch = 0
    train_seconds = 0.0
    if args.resume:
        extra = load_checkpoint(
            previous[-1], model, optimizer, scheduler=scheduler
        )  # decentadam: both optimizers
        step, epoch, start_batch = int(extra["step"]), int(extra["epoch"]), int(extra["batch"])
        train_seconds = float(extra["train_seconds"])
        accelerator.print(f"resumed from {previous[-1]} at step {step} (epoch {epoch}, batch {start_batch})")
    accelerator.init_trackers("tb")

    def evaluate() -> float:
        """Validation NLL per target token, of the consensus model (the exact average over ranks)."""
        context = averaged(model, optimizer) if decentralized else _nothing()  # decentadam
        totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        with context, torch.no_grad():
            model.eval()
            for _, batch in data.iterate(valid_set, valid_batches, pad_id):
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                _, nll, tokens = loss_and_tokens(model, batch, 0.0)
                totals += torch.stack([nll.double(), tokens.double()])
            model.train()
        totals = accelerator.reduce(totals, reduction="sum")
        return float(totals[0] / totals[1])

    def save() -> None:
        extra = {"step": step, "epoch": epoch, "batch": start_batch, "train_seconds": train_seconds}
        save_checkpoint(  # decentadam: the consensus model, every rank's state, the tokenizer; atomic
            checkpoints.step_dir(run, step),
            model,
            optimizer,
            scheduler=scheduler,
            extra=extra,
            processor=tokenizer,
        )
        checkpoints.prune(run, cfg.train.keep_last, accelerator)

    # 3. Training: one optimizer step per grad_accum micro-batches; evaluate, log and save on the way.
    from tqdm.auto import tqdm

    progress = tqdm(total=cfg.train.max_steps, initial=step, disable=not accelerator.is_main_process)
    window = torch.zeros(3, dtype=torch.float64)  # loss sum, micro-batches, target tokens since the last log
    window_start = time.perf_counter()
    since = None  # decentadam: communication counters at the last log
    stop = step >= cfg.train.max_steps
    model.train()
    while not stop:
        batches = train_batches.epoch_batches(epoch)
        micro: list[dict[str, torch.Tensor]] = []
        for batch_index, batch in data.iterate(train_set, batches, pad_id, start=start_batch):
            micro.append(batch)
            if len(micro) < cfg.train.grad_accum:
                continue
            begin = time.perf_counter()
            for position, micro_batch in enumerate(micro):
                micro_batch = {k: v.to(accelerator.device) for k, v in micro_batch.items()}
                last = position == len(micro) - 1
                # DDP all-reduces gradients on the last micro-batch only; decentralized never does.
                with _nothing() if last or decentralized else accelerator.no_sync(model):
                    loss, _, tokens = loss_and_tokens(model, micro_batch, o.label_smoothing)
                    accelerator.backward(loss / len(micro))
                window += torch.tensor([float(loss.detach()), 1.0, float(tokens)], dtype=torch.float64)
            micro.clear()
            if o.clip_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), o.clip_norm)  # this rank's gradient
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            train_seconds += time.perf_counter() - begin
            step, start_batch = step + 1, batch_index + 1
            progress.update(1)
            stop = step >= cfg.train.max_steps

            if step % cfg.train.log_every == 0 or stop:
                totals = accelerator.reduce(window.to(accelerator.device), reduction="sum").cpu()
                elapsed = time.perf_counter() - window_start
                values = {
                    "train/loss": float(totals[0] / totals[1]),
                    "train/tokens_per_s": float(totals[2]) / elapsed,
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/seconds": train_seconds,
                }
                if torch.cuda.is_available():
                    values["train/peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                if decentralized:
                    health = metrics(optimizer, since=since)  # decentadam: all-reduces a copy of the weights
                    since = optimizer.optimizer.stats.snapshot()
                    values["decentadam/consensus_distance_rel"] = health["decentadam/consensus_distance_rel"]
                    values["decentadam/comm_wait_ms"] = health["decentadam/comm_wait_ms"]
                accelerator.log(values, step=step)
                postfix = {
                    "loss": f"{values['train/loss']:.3f}",
                    "tok/s": f"{values['train/tokens_per_s']:.0f}",
                }
                if decentralized:
                    postfix["consensus"] = f"{values['decentadam/consensus_distance_rel']:.1e}"
                progress.set_postfix(postfix)
                window.zero_()
                # every rank stops at the same step: rank 0's clock decides
                if cfg.train.max_minutes > 0:
                    out_of_time = torch.tensor([float(train_seconds >= 60 * cfg.train.max_minutes)])
                    stop = stop or bool(accelerator.gather(out_of_time.to(accelerator.device)).max() > 0)
            if step % cfg.train.eval_every == 0 or stop:
                valid_nll = evaluate()
                accelerator.log({"valid/nll": valid_nll, "valid/ppl": math.exp(valid_nll)}, step=step)
                if accelerator.is_main_process:  # tqdm.write keeps the bar below the line
                    progress.write(
                        f"step {step}  valid nll {valid_nll:.4f}  ({train_seconds:.0f} s of training)"
                    )
                if accelerator.is_main_process:
                    record = {
                        "step": step,
                        "train_seconds": train_seconds,
                        "valid_nll": valid_nll,
                        "epoch": epoch,
                    }
                    with open(run / "metrics.jsonl", "a") as handle:
                        handle.write(json.dumps(record) + "\n")
            if step % cfg.train.save_every == 0 or stop:
                save()
            if step % cfg.train.log_every == 0:  # the tokens/s window starts after evaluation and saving
                window_start = time.perf_counter()
            if stop:
                break
        else:
            epoch, start_batch = epoch + 1, 0
    progress.close()
    if decentralized:
        optimizer.optimizer.close()  # decentadam: let the last exchange finish, release the exchange groups
    accelerator.end_training()
    peak = (
        f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        if torch.cuda.is_available()
        else ""
    )
    accelerator.print(f"done: step {step}, {train_seconds:.0f} s of training{peak}; checkpoints in {run}")


class _nothing:
    """A do-nothing context manager (``contextlib.nullcontext`` without its generic type)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def entry() -> None:
    """Bad input ends the run with its message on stderr (once, from rank 0), not a traceback per rank."""
    try:
        main()
    except (config.ConfigError, data.DataError) as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()
