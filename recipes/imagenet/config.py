"""The recipe's configuration: one small dataclass per section, with a docstring per field.

Presets are the TOML files in ``presets/``; :mod:`recipes.common.config` loads one, applies
``section.key=value`` overrides from the command line and writes the effective configuration back
as TOML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recipes.common import optim as common
from recipes.common.config import ConfigError, Presets, dump

__all__ = ["PRESETS", "Config", "ConfigError", "dump", "load"]


@dataclass
class DataConfig:
    path: str = ""
    """Image folder with ``train/`` and ``val/`` (one sub-folder per class), a local ``datasets``
    directory with ``image`` and ``label`` columns (``save_to_disk``'s, or parquet files in the hub's
    layout) or a hub name (``ILSVRC/imagenet-1k``), the last two read with ``datasets``."""
    train_split: str = "train"
    """Split to train on (a sub-folder of ``path``, or a ``datasets`` split)."""
    val_split: str = "val"
    """Split for the accuracy during training (``validation`` on the hub)."""
    image_size: int = 224
    """Side of the square crop the model sees, in training and in evaluation."""
    crop_pct: float = 0.875
    """Evaluation: resize the shorter side to ``image_size / crop_pct``, then centre-crop ``image_size``."""
    scale: tuple[float, float] = (0.08, 1.0)
    """Random resized crop: range of the crop's area as a fraction of the image's."""
    ratio: tuple[float, float] = (0.75, 4.0 / 3.0)
    """Random resized crop: range of the crop's aspect ratio (width / height)."""
    hflip: float = 0.5
    """Probability of a horizontal flip in training (0 for digits and text)."""
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    """Per-channel mean subtracted after scaling pixels to [0, 1] (RGB)."""
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    """Per-channel standard deviation divided by after subtracting the mean."""
    num_workers: int = 8
    """DataLoader worker processes per rank (0 = load in the training process)."""


@dataclass
class ModelConfig:
    name: str = "resnet50"
    """``resnet50`` (ResNetConfig's defaults), ``resnet-small`` (the sizes below, for CPUs), or any
    ``AutoConfig`` name or directory of an image-classification model (random initialisation)."""
    layer_type: str = "basic"
    """``resnet-small``: ``basic`` (two 3x3 convolutions) or ``bottleneck`` blocks."""
    embedding_size: int = 32
    """``resnet-small``: channels of the stem convolution."""
    hidden_sizes: tuple[int, int, int, int] = (32, 64, 128, 256)
    """``resnet-small``: channels of the four stages."""
    depths: tuple[int, int, int, int] = (1, 1, 1, 1)
    """``resnet-small``: blocks per stage."""
    channels_last: bool = True
    """On a GPU, keep activations in channels-last memory format (faster convolutions); ignored on CPU."""


@dataclass
class OptimConfig(common.OptimConfig):
    """``[optim]``: :class:`recipes.common.optim.OptimConfig` with ResNet-50's defaults (the paper's
    AccumAdam), and its schedule."""

    lr: float = 1.5e-3
    """Peak learning rate, for ``lr_batch`` images per step (see there)."""
    weight_decay: float = 2.0**-15
    lr_batch: int = 0
    """Linear scaling: the peak rate is ``lr * global_batch / lr_batch`` (0 = ``lr`` as is)."""
    warmup_epochs: float = 5.0
    """Linear warm-up from 0 to the peak rate over this many epochs, then cosine decay to 0."""


@dataclass
class TrainConfig:
    global_batch: int = 1024
    """Images per optimizer step over all ranks; each rank takes ``global_batch / processes``."""
    epochs: float = 90.0
    """Length of training in passes over the training set (sets the cosine schedule's length)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = ``epochs``); the schedule still spans ``epochs``
    unless ``schedule_steps`` says otherwise."""
    schedule_steps: int = 0
    """Length of the warm-up + cosine schedule in steps (0 = ``epochs`` worth of steps)."""
    seed: int = 0
    """Model initialisation, data order and augmentation."""
    val_batch: int = 256
    """Images per validation batch and rank."""
    log_every: int = 100
    """Steps between progress and TensorBoard logs (loss, images/s, learning rate, consensus distance)."""
    eval_every: int = 1000
    """Steps between top-1/top-5 evaluations of the consensus model (and one at the end)."""
    save_every: int = 5000
    """Steps between checkpoints (and one at the end)."""
    max_minutes: float = 0.0
    """Also stop once this many minutes of training time have passed (0 = no limit); checked at every
    log step. Training time includes waiting for data; logging, evaluation and saving are excluded."""
    keep_last: int = 3
    """Checkpoints kept in the run directory, the newest (0 = all); older ones are deleted."""
    report_to: str = "tensorboard"
    """Tracker of the logged values (``recipes/common/trackers.py``): ``tensorboard`` (events under
    ``tb/``), ``wandb``, ``all`` (every installed one) or ``none``."""
    log_format: str = "auto"
    """Progress on stderr (``--log-format``): ``auto`` (a bar on a terminal, else one text line per log
    step), ``bar``, ``text`` or ``json`` (one JSON object per line); ``recipes/common/progress.py``."""
    mixed_precision: str = "auto"
    """``auto`` (bf16 on a GPU that supports it, else fp32), ``no``, ``bf16`` or ``fp16``."""
    output_dir: str = "runs/imagenet"
    """Run directory: config.toml, metrics.jsonl, TensorBoard events under tb/ (W&B files under
    wandb/), step-N checkpoints."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


PRESETS = Presets(Config, Path(__file__).resolve().parent / "presets")
"""The files of ``presets/``: ``PRESETS.names()``, ``PRESETS.load(name, overrides)``."""
load = PRESETS.load
