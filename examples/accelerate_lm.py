"""Decentralized training in a plain Accelerate loop: a small character-level GPT-2.

CPU-only machine, 4 processes (gloo)::

    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 4 \\
        examples/accelerate_lm.py --text DATA/multi30k/train.en.gz --ranks-per-node 2

GPUs (NCCL), 2 nodes x 4 GPUs, bf16 (run on each node with its --machine_rank)::

    accelerate launch --multi_gpu --num_machines 2 --num_processes 8 --machine_rank 0 \\
        --main_process_ip HOST --main_process_port 29500 --mixed_precision bf16 \\
        examples/accelerate_lm.py --text train.en.gz

Without ``--text`` the script trains on a small built-in corpus. The loop is the usual Accelerate
loop; the decentralized parts are marked ``# decentadam``: the optimizer, ``prepare`` (no DDP
wrapper), the metrics hook, evaluation on the consensus model and the checkpoint. ``--resume DIR``
continues from a checkpoint written by ``--output-dir``, exactly as if the run had not stopped (with
the same number of processes and ``--seed``): every rank's parameters, AccumAdam state, learning-rate
schedule and random state come from the checkpoint, and the data order from the seed and the
position saved with it (epoch and batch, through Accelerate's seedable sampler).

``--resume auto`` continues from ``--output-dir``'s checkpoint when it holds one and starts a new run
when it does not; with ``--save-every N`` (a checkpoint every N steps, replacing the previous one
atomically) a launcher can restart a failed run unattended and lose at most N steps::

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 --max_restarts 3 \\
        examples/accelerate_lm.py --output-dir runs/lm --save-every 50 --resume auto
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from char_data import CharDataset, load_text, split, tiny_gpt2, vocabulary_of
from torch.utils.data import DataLoader

from decentadam import SETTINGS, Comm, DecentralizedAdam, checkpoint_files, make_setting
from decentadam.checkpoint import load_checkpoint, save_checkpoint
from decentadam.consensus import averaged
from decentadam.distributed import init_restartable_process_group
from decentadam.integrations.accelerate import log_metrics_every, prepare


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--text", help="training text, .txt or .gz, one sentence per line (default: built-in)"
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch and process")
    parser.add_argument("--block", type=int, default=64, help="characters per sequence")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then inverse sqrt")
    parser.add_argument(
        "--setting",
        default="default",
        help=f"DecentralizedAdam's setting: {', '.join(SETTINGS)} (docs/choosing.md)",
    )
    parser.add_argument("--topology", help="complete, ring, one-peer-exp or aer (default: the setting's)")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        help="ranks per node (default: the launcher's LOCAL_WORLD_SIZE); on one machine 2 emulates nodes of "
        "2 ranks, whose nodes then gossip (with every process on one node the default setting is DDP)",
    )
    parser.add_argument("--log-every", type=int, default=50, help="steps between logs and evaluations")
    parser.add_argument("--output-dir", help="write a checkpoint here at the end")
    parser.add_argument(
        "--save-every", type=int, default=0, help="also write it every N steps (0: at the end only)"
    )
    parser.add_argument(
        "--resume",
        help="continue from this checkpoint; 'auto': from --output-dir's if it holds one, else start anew",
    )
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    args = parser.parse_args()
    if (args.resume == "auto" or args.save_every) and not args.output_dir:
        parser.error("--resume auto and --save-every need --output-dir (where the checkpoint goes)")
    return args


def resume_from(args: argparse.Namespace) -> str | None:
    """The checkpoint ``--resume`` names: for ``auto``, ``--output-dir`` if it holds a complete one.

    ``auto`` starts a new run when ``--output-dir`` is absent or empty, and refuses one that holds
    something else (saving there would fail at the first save, after the training it cost).
    """
    named: str | None = args.resume
    if named != "auto":
        return named
    output = Path(args.output_dir)
    checkpoint_files.recover(output)  # a save killed between its two renames: take the previous one
    if checkpoint_files.is_foreign(output):
        raise SystemExit(
            f"--resume auto: --output-dir {output} holds files but no complete decentadam checkpoint "
            f"({checkpoint_files.meta_file(output)} is missing): it is not this run's. Pass a new or empty "
            "--output-dir, or the checkpoint directory of the run to continue."
        )
    return str(output) if checkpoint_files.is_checkpoint(output) else None


def main() -> None:
    args = parse_args()
    resume = resume_from(args)
    set_seed(args.seed)
    init_restartable_process_group()  # under torchrun --max-restarts: each attempt its own keys
    accelerator = Accelerator(  # a seedable sampler: the data order is a function of (seed, epoch)
        gradient_accumulation_steps=args.grad_accum,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    train_text, val_text = split(load_text(args.text))
    vocabulary = vocabulary_of(train_text)
    train_set = CharDataset(train_text, vocabulary, args.block)
    val_set = CharDataset(val_text, vocabulary, args.block)
    # Loaders with generators of their own: starting to iterate one then draws no number from the
    # global RNG, which dropout uses, so evaluating or resuming mid-epoch leaves training unchanged.
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )  # fmt: skip
    val_loader = DataLoader(val_set, batch_size=args.batch_size, generator=torch.Generator())

    model = tiny_gpt2(vocabulary, args.block).to(accelerator.device)  # on its device before the optimizer
    optimizer = DecentralizedAdam(  # decentadam
        model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.01,
        setting=make_setting(args.setting, topology=args.topology),
        comm=Comm(local_world_size=args.ranks_per_node),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: min((t + 1) / args.warmup, math.sqrt(args.warmup / (t + 1)))
    )
    model, optimizer, train_loader, val_loader, scheduler = prepare(  # decentadam: no DDP
        accelerator, model, optimizer, train_loader, val_loader, scheduler
    )
    log_metrics_every(accelerator, optimizer, every=args.log_every)  # decentadam
    start_step = epoch = start_batch = 0  # start_batch: micro-batches of `epoch` already trained on
    if resume:
        extra = load_checkpoint(resume, model, optimizer, scheduler=scheduler)
        start_step, epoch, start_batch = int(extra["step"]), int(extra["epoch"]), int(extra["batch"])
        accelerator.print(f"resumed from {resume} at step {start_step}")

    def save(epoch: int, batch: int) -> None:
        save_checkpoint(  # decentadam: the consensus model and every rank's state, atomically
            args.output_dir, model, optimizer, scheduler=scheduler,
            extra={"step": step, "epoch": epoch, "batch": batch},
        )  # fmt: skip

    def evaluate() -> float:
        with averaged(model, optimizer), torch.no_grad():  # decentadam: the consensus model
            model.eval()
            losses = [accelerator.gather(model(**batch).loss.reshape(1)) for batch in val_loader]
            model.train()
        return float(torch.cat(losses).mean())

    first_val = evaluate()
    accelerator.print(
        f"{accelerator.num_processes} processes, topology {optimizer.optimizer.topology.name}: "
        f"val loss {first_val:.4f}"
    )
    step, seconds, window = start_step, [], []
    while step < args.steps:
        train_loader.set_epoch(epoch)
        epoch_batches = train_loader
        if start_batch:  # resumed mid-epoch: the same order, without the batches trained on
            epoch_batches = accelerator.skip_first_batches(train_loader, start_batch)
        for batch_index, batch in enumerate(epoch_batches, start=start_batch):
            begin = time.perf_counter()
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # this rank's gradient norm
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window.append(loss.detach())
            if not accelerator.sync_gradients:
                continue
            step += 1
            seconds.append(time.perf_counter() - begin)
            if step % args.log_every == 0 or step == args.steps:
                train_loss = float(accelerator.gather(torch.stack(window).mean().reshape(1)).mean())
                window.clear()
                distance = optimizer.optimizer.consensus_distance(relative=True)
                accelerator.print(
                    f"step {step:5d}  train loss {train_loss:.4f}  val loss {evaluate():.4f}  "
                    f"consensus distance (relative) {distance:.2e}  "
                    f"{1e3 * sorted(seconds)[len(seconds) // 2]:.1f} ms/step (median, rank 0)"
                )
            if step == args.steps:
                start_batch = batch_index + 1
                break
            if args.save_every and step % args.save_every == 0:
                save(epoch, batch_index + 1)
        else:
            epoch, start_batch = epoch + 1, 0

    if args.output_dir:
        save(epoch, start_batch)
        accelerator.print(f"saved the consensus model and every rank's state to {args.output_dir}")
    optimizer.optimizer.close()  # decentadam: let the last exchange finish, release the exchange groups
    accelerator.end_training()


if __name__ == "__main__":
    main()
