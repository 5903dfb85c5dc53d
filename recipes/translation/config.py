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
    """Directory of ``{split}.{lang}[.gz]`` files, a local ``datasets`` directory with a ``translation``
    column (``save_to_disk``'s, or parquet files in the hub's layout) or a hub name (``wmt/wmt14``)."""
    src: str = "en"
    """Source language code (the file suffix, e.g. ``en``)."""
    tgt: str = "de"
    """Target language code."""
    train_split: str = "train"
    """Split to train on."""
    val_split: str = "val"
    """Split for the validation loss during training (``validation`` on the hub)."""
    test_split: str = "test_2016_flickr"
    """Split that the BLEU commands score (``test`` on the hub); not read by training."""
    vocab_size: int = 8000
    """Size of the joint source+target BPE vocabulary trained from the training text."""
    tokenizer: str = ""
    """Directory of a saved tokenizer to use instead of training one ("" = train, or reuse the cached one)."""
    cache_dir: str = ""
    """Where trained tokenizers and the token caches of the splits are kept ("" =
    ``~/.cache/decentadam/translation``); the main process writes them, the other ranks read them."""
    tokenizer_sample: int = 1_000_000
    """Training pairs the tokenizer is trained on, drawn uniformly with a fixed seed (0 = all pairs)."""
    max_length: int = 256
    """Training pairs with a side longer than this many tokens are dropped."""
    limit: int = 0
    """Train on the first N pairs only (0 = all)."""
    val_limit: int = 0
    """Validate on the first N pairs only (0 = all)."""


@dataclass
class ModelConfig:
    layers: int = 6
    """Encoder layers, and as many decoder layers."""
    d_model: int = 512
    """Width of the residual stream and the embeddings."""
    ffn_dim: int = 2048
    """Hidden width of the feed-forward blocks."""
    heads: int = 8
    """Attention heads."""
    dropout: float = 0.1
    """Dropout on the residual branches and embeddings."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    activation_dropout: float = 0.0
    """Dropout after the feed-forward activation."""
    max_positions: int = 1024
    """Longest sequence the positional embeddings cover."""


@dataclass
class OptimConfig(common.OptimConfig):
    """``[optim]``: :class:`recipes.common.optim.OptimConfig` with the Transformer's defaults, and its
    schedule. ``--optimizer``: ``allreduce`` or ``decentralized``."""

    lr: float = 7e-4
    betas_allreduce: tuple[float, float] = (0.9, 0.98)
    betas_decentralized: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    warmup_steps: int = 4000
    """Linear warm-up steps, then the rate decays as 1/sqrt(step) (the Transformer's schedule)."""
    clip_norm: float = 0.0
    """Clip each rank's gradient to this norm (0 = no clipping)."""


@dataclass
class TrainConfig:
    global_tokens: int = 25000
    """Token budget of one optimizer step, over all ranks and micro-batches (a batch costs sentences x
    its longest source or target)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    max_steps: int = 100000
    """Optimizer steps to train for."""
    max_minutes: float = 0.0
    """Also stop once this many minutes of training time have passed (0 = no limit); checked at every
    log step. Training time includes waiting for data; logging, evaluation and saving are excluded."""
    seed: int = 1
    """Model initialisation, dropout and data order."""
    log_every: int = 100
    """Steps between progress logs (train loss, tokens/s, consensus distance) and TensorBoard points."""
    eval_every: int = 1000
    """Steps between validation losses (on the consensus model)."""
    save_every: int = 1000
    """Steps between checkpoints (and one at the end)."""
    keep_last: int = 5
    """Checkpoints kept in the run directory, the newest (0 = all); older ones are deleted."""
    val_tokens: int = 8000
    """Token budget of a validation batch per rank."""
    report_to: str = "tensorboard"
    """Tracker of the logged values (``recipes/common/trackers.py``): ``tensorboard`` (events under
    ``tb/``), ``wandb``, ``all`` (every installed one) or ``none``."""
    log_format: str = "auto"
    """Progress on stderr (``--log-format``): ``auto`` (a bar on a terminal, else one text line per log
    step), ``bar``, ``text`` or ``json`` (one JSON object per line); ``recipes/common/progress.py``."""
    mixed_precision: str = "auto"
    """``auto`` (bf16 on a GPU that has it, else fp32), ``no``, ``bf16`` or ``fp16``."""
    timeout_s: float = 0.0
    """Seconds a collective or a decentralized exchange waits for a rank that stalled or died before
    the run fails (0 = torch's default, 30 minutes); a launcher's --max-restarts then restarts it,
    and ``--resume auto`` continues from the last checkpoint."""
    output_dir: str = "runs/translation"
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
