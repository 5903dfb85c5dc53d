"""The recipe's configuration: one small dataclass per section, loaded from a preset, overridden as key=value.

A preset is a TOML file in ``presets/`` (or any path) with the sections ``[data]``, ``[model]``,
``[optim]`` and ``[train]``; every key must be a field below. Overrides on the command line are
``section.field=value`` (or ``field=value`` when the name is unique across sections, and
``data=DIR`` for ``data.path``); values are parsed as TOML (``0.1``, ``true``, ``[0.9, 0.98]``) and
anything else is a string. :func:`dump` writes the effective configuration back as TOML.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS = Path(__file__).resolve().parent / "presets"


class ConfigError(ValueError):
    """An unknown preset or key, or a value of the wrong type; the message says what is expected."""


@dataclass
class DataConfig:
    path: str = ""
    """Directory of ``{split}.{lang}[.gz]`` files, or a hub dataset name (``wmt/wmt14``)."""
    src: str = "en"
    """Source language code (the file suffix, e.g. ``en``)."""
    tgt: str = "de"
    """Target language code."""
    train_split: str = "train"
    """Split to train on."""
    valid_split: str = "val"
    """Split for the validation loss during training (``validation`` on the hub)."""
    test_split: str = "test_2016_flickr"
    """Split that the BLEU commands score (``test`` on the hub); not read by training."""
    vocab_size: int = 8000
    """Size of the joint source+target BPE vocabulary trained from the training text."""
    tokenizer: str = ""
    """Directory of a saved tokenizer to use instead of training one ("" = train, or reuse the cached one)."""
    cache_dir: str = ""
    """Where trained tokenizers are cached ("" = ``~/.cache/decentadam/translation``)."""
    max_length: int = 256
    """Training pairs with a side longer than this many tokens are dropped."""
    limit: int = 0
    """Train on the first N pairs only (0 = all)."""
    valid_limit: int = 0
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
class OptimConfig:
    optimizer: str = "decentralized"
    """``allreduce`` (AdamW under Accelerate's DDP: the baseline) or ``decentralized`` (DecentralizedAdam)."""
    lr: float = 7e-4
    """Peak learning rate, reached after the warm-up."""
    warmup_steps: int = 4000
    """Linear warm-up steps, then the rate decays as 1/sqrt(step) (the Transformer's schedule)."""
    betas_allreduce: tuple[float, float] = (0.9, 0.98)
    """Adam betas of the All-Reduce baseline."""
    betas_decentralized: tuple[float, float] = (0.9, 0.999)
    """Adam betas of AccumAdam (the paper uses a larger beta2 for it)."""
    eps: float = 1e-9
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (not on biases and norms)."""
    clip_norm: float = 0.0
    """Clip each rank's gradient to this norm (0 = no clipping)."""
    label_smoothing: float = 0.1
    """Label smoothing of the training loss."""
    topology: str = "aer"
    """Graph of the parameter averaging: ``aer``, ``complete``, ``ring``, ``one-peer-exp``."""
    accum_steps: int = 4
    """AccumAdam window s: the moments advance once per s steps with the window's mean gradient."""
    local_world_size: int = 0
    """Ranks per node for ``aer`` (0 = the launcher's LOCAL_WORLD_SIZE); 2 on one machine emulates
    nodes of 2."""


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
    """Also stop once this many minutes of training (evaluation excluded) have passed (0 = no limit);
    checked at every log step."""
    seed: int = 1
    """Model initialisation, dropout and data order."""
    log_every: int = 100
    """Steps between progress logs (train loss, tokens/s, consensus distance) and TensorBoard points."""
    eval_every: int = 1000
    """Steps between validation losses (on the consensus model)."""
    save_every: int = 1000
    """Steps between checkpoints (and one at the end)."""
    keep_last: int = 5
    """Checkpoints kept in the run directory (the oldest are deleted)."""
    valid_tokens: int = 8000
    """Token budget of a validation batch per rank."""
    mixed_precision: str = "auto"
    """``auto`` (bf16 on a GPU that has it, else fp32), ``no``, ``bf16`` or ``fp16``."""
    output_dir: str = "runs/translation"
    """Run directory: config.toml, metrics.jsonl, TensorBoard events and step-N checkpoints."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


SECTIONS = [f.name for f in dataclasses.fields(Config)]


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.toml"))


def preset_path(name: str) -> Path:
    """``presets/NAME.toml``, or ``name`` itself when it is a path to a TOML file."""
    candidate = Path(name)
    if candidate.suffix == ".toml" and candidate.is_file():
        return candidate
    path = PRESETS / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown preset {name!r}: expected one of {', '.join(available_presets())} or a .toml file"
        )
    return path


def load(preset: str | None, overrides: list[str] | None = None) -> Config:
    """The default config, updated by the preset file and then by ``key=value`` overrides."""
    config = Config()
    if preset:
        path = preset_path(preset)
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path} is not valid TOML: {error}") from None
        for section, entries in values.items():
            if section not in SECTIONS or not isinstance(entries, dict):
                raise ConfigError(f"{path}: unknown section [{section}]; expected {', '.join(SECTIONS)}")
            for key, value in entries.items():
                _set(config, section, key, value, where=f"{path}")
    for item in overrides or []:
        section, key, value = parse_override(item)
        _set(config, section, key, value, where="command line")
    return config


def parse_override(item: str) -> tuple[str, str, Any]:
    """``section.key=value`` (or ``key=value`` for a unique field name) -> (section, key, parsed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.max_steps=100)")
    name, text = item.split("=", 1)
    name = name.strip()
    if name == "data":
        section, key = "data", "path"
    elif "." in name:
        section, key = name.split(".", 1)
    else:
        owners = [s for s in SECTIONS if key_names(s).count(name)]
        if len(owners) != 1:
            known = ", ".join(f"{s}.{k}" for s in SECTIONS for k in key_names(s))
            raise ConfigError(f"unknown config key {name!r}: expected section.key, one of {known}")
        section, key = owners[0], name
    try:
        value: Any = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key, value


def key_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_section_type(section))]


def _section_type(section: str) -> Any:
    return typing.get_type_hints(Config)[section]


def _set(config: Config, section: str, key: str, value: Any, where: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"{where}: unknown config section {section!r} in {section}.{key}; expected {', '.join(SECTIONS)}"
        )
    target = getattr(config, section)
    hints = typing.get_type_hints(type(target))
    if key not in hints:
        raise ConfigError(
            f"{where}: unknown config key {section}.{key}; [{section}] has {', '.join(key_names(section))}"
        )
    setattr(target, key, _coerce(hints[key], value, f"{where}: {section}.{key}"))


def _coerce(kind: Any, value: Any, name: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        return value if isinstance(value, str) else json.dumps(value)
    elif typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_coerce(a, v, name) for a, v in zip(args, value, strict=True))
    expected = getattr(kind, "__name__", str(kind)).replace("tuple", "a list like [0.9, 0.98] for tuple")
    raise ConfigError(f"{name} = {value!r}: expected {expected}")


def dump(config: Config) -> str:
    """The configuration as TOML (what :func:`load` reads back)."""
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            if isinstance(value, tuple):
                value = list(value)
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
