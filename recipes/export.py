"""``decentadam-export``: a recipe's checkpoint as a plain Hugging Face model directory with a model card.

::

    decentadam-export runs/m30k-aer exported/m30k-aer                  # the run's newest checkpoint
    decentadam-export runs/m30k-aer/step-1200 exported/m30k-aer --eval runs/m30k-aer/test.json
    decentadam-export runs/m30k-aer exported/m30k-aer-avg5 --average-last 5
    decentadam-export runs/m30k-aer exported/m30k-aer --overwrite --push-to-hub me/m30k-en-de-aer --private

``RUN_OR_CHECKPOINT`` is a recipe's run directory (its newest complete checkpoint is exported; with
``--average-last K`` the mean of the floating-point weights of its last K, as ``decentadam-bleu
--average-last`` scores them: ``eval.bleu.load_averaged``) or one of its ``step-N`` checkpoints.
``OUT`` receives what ``from_pretrained`` loads and nothing else: ``config.json``,
``model.safetensors`` (the consensus weights, byte for byte; an average is written with
``save_pretrained``), ``generation_config.json``, the tokenizer's or the image processor's files, and
the model card ``README.md``; not ``decentadam/`` (every rank's optimizer state, only for resuming)
nor a Trainer's training state. ``OUT`` is written in a hidden sibling (``.OUT.incomplete``) that is
renamed into place once complete, so a failed export leaves no ``OUT`` (and with ``--overwrite`` the
previous one stays until then); a non-empty ``OUT`` is refused without ``--overwrite``.

The card's numbers are read from the run's files, never computed here: ``decentadam/meta.json`` (world
size, topology, local world size, step, training seconds), ``config.toml`` (data, ``[optim]``),
``metrics.jsonl`` (the evaluation at the exported step; ``train_loss`` when the line has one) and the
JSON that ``decentadam-bleu`` or ``decentadam-accuracy`` wrote with ``--output``: the files given with
``--eval``, else the ``*.json`` files of the run directory that scored exactly the exported
checkpoints. Without one the card says so and gives the command that writes it.

``--push-to-hub OWNER/NAME`` then uploads ``OUT`` with ``huggingface_hub`` (``create_repo`` with
``exist_ok=True``, ``upload_folder``), with the token of ``hf auth login`` or ``HF_TOKEN``;
``--private`` makes a new repository private (an existing one keeps its visibility).

Exit codes are ``eval.contract``'s, with one line ``error: MESSAGE`` on stderr: 2 the command line,
3 an ``--eval`` file that cannot be read, 4 the checkpoint (naming the file), 6 ``OUT`` or the push.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decentadam import checkpoint_files
from eval.contract import CheckpointError, DataError, EvalError, OutputError, UsageError
from recipes.common.run import list_checkpoints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "TASKS", "Exported", "Task", "export", "find_evals", "main", "model_card", "parser", "push", "run",
    "task_of",
]  # fmt: skip

logger = logging.getLogger(__name__)

REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
"""``OWNER/NAME`` of ``--push-to-hub``."""


@dataclass(frozen=True)
class Task:
    """What a recipe's model is and how it is loaded and scored."""

    pipeline_tag: str  # the hub's task name, also the card's task tag
    model_class: str  # transformers' Auto class of the model
    processor_class: str  # and of its preprocessing
    evaluator: str  # the command that scores it (its JSON is what the card reads)


TASKS = {
    "translation": Task("translation", "AutoModelForSeq2SeqLM", "AutoTokenizer", "decentadam-bleu"),
    "image-classification": Task(
        "image-classification", "AutoModelForImageClassification", "AutoImageProcessor", "decentadam-accuracy"
    ),
}

_NOT_EXPORTED = re.compile(
    r"^(README\.md|optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state.*\.pth|trainer_state\.json"
    r"|training_args\.bin|.*\.tmp)$"
)
"""Files of a checkpoint that a model directory does not hold: a Trainer's training state, the card
(written anew) and unfinished writes; ``decentadam/`` and hidden files are left out as well."""
_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
"""Weights files, single or sharded, as ``save_pretrained`` names them."""


@dataclass
class Exported:
    """What an export wrote, and what the card says about it (the run's files, as read)."""

    out: Path
    task: Task
    run: Path  # the run directory holding the checkpoints
    checkpoints: list[Path]  # exported (one) or averaged, oldest first
    step: int  # the newest one's optimizer step
    meta: dict[str, Any]  # its decentadam/meta.json
    config: dict[str, Any] | None  # the run's config.toml, None when absent
    config_text: str | None
    metrics: dict[str, Any] | None  # the metrics.jsonl line of ``step``
    evals: list[tuple[Path, dict[str, Any]]]  # (file, JSON) of the scores of the exported weights
    command: str  # the export command, as the card shows it


# ---------------------------------------------------------------------------- reading the run


def _checkpoints(source: Path, average_last: int) -> tuple[Path, list[Path]]:
    """(run directory, the checkpoints to export) of ``RUN_OR_CHECKPOINT``."""
    if not source.exists():
        raise CheckpointError(
            f"{source} does not exist: give a recipe's run directory or one of its step-N checkpoints"
        )
    if not source.is_dir():
        raise CheckpointError(f"{source} is a file: give a recipe's run directory or one of its step-N")
    if checkpoint_files.is_checkpoint(source):
        if average_last > 1:
            raise UsageError(
                f"--average-last {average_last} averages the last checkpoints of a run: give the run "
                f"directory {source.parent}, not its checkpoint {source.name}"
            )
        return source.parent, [source]
    found = list_checkpoints(source)
    if not found:
        if (source / "config.json").is_file():
            raise CheckpointError(
                f"{checkpoint_files.meta_file(source)} does not exist: {source} is not a complete decentadam "
                "checkpoint (a recipe's step-N, whose metadata is written last); give a run directory or "
                "one of its step-N"
            )
        raise CheckpointError(
            f"{source} holds no complete checkpoint (a step-N directory with decentadam/meta.json): give "
            "a recipe's run directory or one of its step-N checkpoints"
        )
    wanted = max(average_last, 1)
    if wanted > len(found):
        raise UsageError(
            f"--average-last {average_last}: {source} holds {len(found)} complete checkpoints "
            f"({', '.join(p.name for p in found)}); pass --average-last {len(found)} or fewer"
        )
    return source, found[-wanted:]


def task_of(checkpoint: Path) -> Task:
    """The task of the model in ``checkpoint``, from its ``config.json``."""
    file = checkpoint / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{file} does not exist: expected a directory that from_pretrained loads (config.json, the "
            "weights, the tokenizer or image processor)"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file}: cannot read it as JSON ({error})") from None
    architectures = [str(a) for a in config.get("architectures") or []]
    if any(a.endswith("ForImageClassification") for a in architectures):
        return TASKS["image-classification"]
    if config.get("is_encoder_decoder") or any(
        a.endswith(("MTModel", "ForConditionalGeneration")) for a in architectures
    ):
        return TASKS["translation"]
    kind = ", ".join(architectures) or config.get("model_type") or "model of no known architecture"
    raise CheckpointError(
        f"{file}: a {kind}; decentadam-export exports the recipes' models, seq2seq translation "
        "(is_encoder_decoder) and image classification (*ForImageClassification)"
    )


def _step(checkpoint: Path, meta: dict[str, Any]) -> int:
    """The optimizer step of ``checkpoint``: meta.json's (None for All-Reduce), the extra's, the name's."""
    for value in (meta.get("step"), (meta.get("extra") or {}).get("step")):
        if isinstance(value, int):
            return value
    match = re.search(r"-(\d+)$", checkpoint.name)
    if match is None:
        raise CheckpointError(f"{checkpoint_files.meta_file(checkpoint)} records no step, nor does the name")
    return int(match.group(1))


def _metrics_at(run: Path, step: int) -> dict[str, Any] | None:
    """The last ``metrics.jsonl`` line of ``step`` (a resumed run may have recorded it twice)."""
    file = run / "metrics.jsonl"
    if not file.is_file():
        return None
    found = None
    for number, line in enumerate(file.read_text().splitlines(), 1):
        try:
            values = json.loads(line) if line.strip() else None
        except ValueError:
            logger.warning("%s line %d is not JSON; skipped", file, number)
            continue
        if isinstance(values, dict) and values.get("step") == step:
            found = values
    return found


def _same_checkpoint(recorded: str, checkpoint: Path) -> bool:
    """Whether the path an eval JSON recorded is ``checkpoint``: the same directory when it exists from
    here, else the same run and step names (the JSON was written from another working directory)."""
    path = Path(recorded)
    if path.exists():
        return path.resolve() == checkpoint.resolve()
    return path.parts[-2:] == checkpoint.resolve().parts[-2:]


def _scored(result: dict[str, Any]) -> list[str] | None:
    """The checkpoints whose weights an eval JSON scored (decentadam-bleu's averaged ones, or
    decentadam-accuracy's one); None for a JSON that neither wrote."""
    if "bleu" in result and "bleu_signature" in result:
        return [str(p) for p in result.get("checkpoints") or []]
    if "top1" in result and "top5" in result:
        return [str(result["checkpoint"])] if result.get("checkpoint") else []
    return None


def _scores(result: dict[str, Any], checkpoints: list[Path]) -> bool:
    recorded = _scored(result) or []
    return len(recorded) == len(checkpoints) and all(
        _same_checkpoint(r, c) for r, c in zip(recorded, checkpoints, strict=True)
    )


def find_evals(run: Path, checkpoints: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """The JSON files in ``run`` that decentadam-bleu or decentadam-accuracy wrote for exactly
    ``checkpoints`` (the weights exported), by file name."""
    found = []
    for file in sorted(run.glob("*.json")):
        try:
            result = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(result, dict) and _scores(result, checkpoints):
            found.append((file, result))
    return found


def _read_eval(file: Path, task: Task, checkpoints: list[Path]) -> dict[str, Any]:
    """An ``--eval`` file, checked to be a score of the exported weights."""
    try:
        result = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise DataError(f"--eval {file}: cannot read it as JSON ({error})") from None
    recorded = _scored(result) if isinstance(result, dict) else None
    if recorded is None:
        raise DataError(
            f"--eval {file} is not what decentadam-bleu or decentadam-accuracy writes with --output (no "
            "bleu and bleu_signature, nor top1 and top5)"
        )
    if ("bleu" in result) != (task.pipeline_tag == "translation"):
        raise UsageError(f"--eval {file} scores another task than {task.pipeline_tag}: give the model's own")
    if not _scores(result, checkpoints):
        raise UsageError(
            f"--eval {file} scored {', '.join(recorded) or 'a file of translations (--score)'}, not the "
            f"exported {', '.join(str(c) for c in checkpoints)}: give the JSON of these weights"
        )
    return dict(result)


def _command(
    source: Path,
    out: Path,
    average_last: int,
    evals: Sequence[Path],
    push_to_hub: str | None,
    private: bool,
    overwrite: bool,
) -> str:
    words = ["decentadam-export", str(source), str(out)]
    words += ["--average-last", str(average_last)] if average_last else []
    for file in evals:
        words += ["--eval", str(file)]
    words += ["--push-to-hub", push_to_hub] if push_to_hub else []
    words += ["--private"] if private else []
    words += ["--overwrite"] if overwrite else []
    return shlex.join(words)


# ---------------------------------------------------------------------------- writing OUT


def _check_out(out: Path, overwrite: bool, inputs: Sequence[Path]) -> None:
    """Raise OutputError unless OUT may be written: new, empty, or (``overwrite``) a directory that
    holds none of the inputs."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"{out} is a file: OUT is the directory the model is written to; give another")
    target = out.resolve()
    for path in inputs:
        if target == path.resolve() or target in path.resolve().parents:
            raise OutputError(f"{out} is or holds {path}, which is being exported: give another OUT")
    if out.is_dir() and not overwrite and (held := sorted(p.name for p in out.iterdir())):
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise OutputError(
            f"{out} is not empty ({shown}): pass --overwrite to replace it, or give a new directory"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{out}: cannot create its folder ({error})") from None


def _write(staging: Path, checkpoints: list[Path], model: Any) -> None:
    """The model directory in ``staging``: the newest checkpoint's files but the training state, and
    its weights as they are (one checkpoint of safetensors) or the average's, by ``save_pretrained``."""
    newest = checkpoints[-1]
    copy_weights = len(checkpoints) == 1 and any(
        (newest / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
    )
    for file in sorted(newest.iterdir()):
        if file.name.startswith(".") or not file.is_file() or _NOT_EXPORTED.match(file.name):
            continue  # decentadam/ (a directory), hidden staging files, the training state
        if _WEIGHTS.match(file.name) and not (copy_weights and "safetensors" in file.name):
            continue
        shutil.copy2(file, staging / file.name)
    if not copy_weights:
        model.save_pretrained(str(staging))  # config.json, generation_config.json, model.safetensors


def export(
    source: str | Path,
    out: str | Path,
    *,
    average_last: int = 0,
    evals: Sequence[str | Path] = (),
    overwrite: bool = False,
    push_to_hub: str | None = None,
    private: bool = False,
) -> Exported:
    """Write the checkpoint(s) of ``source`` to ``out`` as a model directory with a model card (the
    module docstring); ``push_to_hub`` and ``private`` only name the repository in the card (:func:`push`
    uploads). Raises :class:`eval.contract.EvalError` subclasses with one line for bad input."""
    import transformers

    from eval.bleu import load_averaged

    source, out = Path(source), Path(out)
    if average_last < 0:
        raise UsageError(f"--average-last {average_last}: expected K >= 1 (or none: the newest checkpoint)")
    run, checkpoints = _checkpoints(source, average_last)
    _check_out(out, overwrite, [run, *checkpoints])
    newest = checkpoints[-1]
    task = task_of(newest)
    eval_files = [Path(f) for f in evals]
    given = [(file, _read_eval(file, task, checkpoints)) for file in eval_files]

    model_class = getattr(transformers, task.model_class)
    if len(checkpoints) == 1:
        model, used = load_averaged(newest, 0, model_class)
    else:
        model, used = load_averaged(run, len(checkpoints), model_class)
    assert [p.resolve() for p in used] == [p.resolve() for p in checkpoints], (used, checkpoints)
    try:
        getattr(transformers, task.processor_class).from_pretrained(str(newest))
    except (OSError, ValueError, KeyError) as error:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise CheckpointError(
            f"{newest}: its {task.processor_class[4:]} files are not ones that from_pretrained loads "
            f"({first[:300]})"
        ) from None
    try:
        meta = checkpoint_files.read_meta(newest)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{checkpoint_files.meta_file(newest)}: {error}") from None
    step = _step(newest, meta)
    config_file = run / "config.toml"
    config_text = config_file.read_text() if config_file.is_file() else None
    try:
        config = tomllib.loads(config_text) if config_text is not None else None
    except tomllib.TOMLDecodeError as error:
        logger.warning(
            "%s is not TOML (%s): the card leaves the training configuration out", config_file, error
        )
        config = None
    exported = Exported(
        out=out, task=task, run=run, checkpoints=checkpoints, step=step, meta=meta, config=config,
        config_text=config_text if config is not None else None, metrics=_metrics_at(run, step),
        evals=given if eval_files else find_evals(run, checkpoints),
        command=_command(source, out, average_last, eval_files, push_to_hub, private, overwrite),
    )  # fmt: skip

    staging = checkpoint_files.sibling(out, "incomplete")
    try:
        if staging.exists():
            shutil.rmtree(staging)  # left by an export that was killed
        staging.mkdir()
        _write(staging, checkpoints, model)
        (staging / "README.md").write_text(model_card(exported, push_to_hub or out.name), encoding="utf-8")
        checkpoint_files.replace_directory(staging, out)
    except OSError as error:
        raise OutputError(f"{out}: cannot write it ({error}); nothing was written there") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("exported %s to %s", ", ".join(str(c) for c in checkpoints), out)
    return exported


# ---------------------------------------------------------------------------- the model card


_LABELS = {
    "valid_nll": "validation NLL (valid_nll)",
    "train_loss": "training loss (train_loss)",
    "top1": "validation top-1",
    "top5": "validation top-5",
    "loss": "validation loss",
}
"""How the recipes' ``metrics.jsonl`` keys read in the card; other keys are shown by name."""
_NOT_METRICS = frozenset(("step", "train_seconds", "epoch", "epochs"))  # the card's Training section's


def _scores_of(metrics: dict[str, Any]) -> list[tuple[str, float]]:
    """The scores of a ``metrics.jsonl`` line: its numbers but the step, the time and the epoch."""
    return [
        (key, value)
        for key, value in metrics.items()
        if key not in _NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)
    ]


def _number(value: Any) -> str:
    """A number as the card prints it: integers whole, floats to 4 significant digits."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds:.1f} s ({seconds / 60:.1f} min)"
    return f"{seconds:.1f} s ({seconds / 3600:.2f} h)"


def _section(exported: Exported, name: str) -> dict[str, Any]:
    value = (exported.config or {}).get(name)
    return value if isinstance(value, dict) else {}


def _eval_command(task: Task, result: dict[str, Any]) -> str:
    """The evaluation command an eval JSON records (its checkpoint, data and decoding options)."""
    if task.pipeline_tag == "translation":
        words = ["decentadam-bleu", str(result.get("checkpoint"))]
        if result.get("checkpoint") not in result.get("checkpoints", []):
            words += ["--average-last", str(len(result.get("checkpoints", [])))]
        words += ["--data", str(result.get("data")), "--split", str(result.get("split"))]
        words += ["--src", str(result.get("src")), "--tgt", str(result.get("tgt"))]
        tokenize = re.search(r"tok:([^|]+)", str(result.get("bleu_signature", "")))
        if tokenize and tokenize.group(1) != "13a":
            words += ["--tokenize", tokenize.group(1)]
        for key in ("beam", "length_penalty", "max_len_b"):
            if key in result:
                words += [f"--{key.replace('_', '-')}", str(result[key])]
    else:
        words = ["decentadam-accuracy", str(result.get("checkpoint")), "--data", str(result.get("data"))]
        words += ["--split", str(result.get("split"))]
    return shlex.join(words)


def _missing_eval(exported: Exported) -> str:
    """What the card says without an eval JSON: the command that writes one."""
    data = _section(exported, "data")
    path = str(data.get("path") or "DATA")
    if exported.task.pipeline_tag == "translation":
        src, tgt = str(data.get("src") or "SRC"), str(data.get("tgt") or "TGT")
        split = str(data.get("test_split") or "test")
        target = str(exported.run) if len(exported.checkpoints) > 1 else str(exported.checkpoints[-1])
        words = ["decentadam-bleu", target]
        words += ["--average-last", str(len(exported.checkpoints))] if len(exported.checkpoints) > 1 else []
        words += ["--data", path, "--split", split, "--src", src, "--tgt", tgt]
        words += ["--output", str(exported.run / f"{split}.{src}-{tgt}.json")]
        what = "BLEU and chrF"
    else:
        split = str(data.get("val_split") or "val")
        if len(exported.checkpoints) > 1:  # decentadam-accuracy does not average: score the export
            return (
                "No accuracy of this average is known: decentadam-accuracy scores one directory. Score the "
                f"exported one with `decentadam-accuracy {shlex.quote(str(exported.out))} --data "
                f"{shlex.quote(path)} --split {shlex.quote(split)}`.\n"
            )
        words = ["decentadam-accuracy", str(exported.checkpoints[-1]), "--data", path, "--split", split]
        words += ["--output", str(exported.run / f"{split}.json")]
        what = "top-1 and top-5 accuracy"
    return (
        f"No {what} of these weights is recorded: no JSON written by {exported.task.evaluator} "
        f"(`--output`) in {exported.run} scored them. To score them, then export again (the file is found "
        f"in the run directory, or pass `--eval FILE`):\n\n```bash\n{shlex.join(words)}\n```\n"
    )


def _card_data(exported: Exported, name: str) -> str:
    """The card's YAML front matter (huggingface_hub's ModelCardData: tags, task, model-index)."""
    from huggingface_hub import EvalResult, ModelCardData

    task, data = exported.task.pipeline_tag, _section(exported, "data")
    dataset = str(data.get("path") or "unknown")
    scores: list[tuple[str, str, str, str, Any, str | None]] = []  # data, split, type, name, value, config
    for _, result in exported.evals:
        on = (str(result.get("data") or dataset), str(result.get("split")))
        if task == "translation":
            scores += [(*on, "bleu", "BLEU", result["bleu"], str(result["bleu_signature"]))]
            if "chrf" in result:
                scores += [(*on, "chrf", "chrF", result["chrf"], str(result.get("chrf_signature")))]
        else:
            scores += [(*on, "accuracy", "top-1 accuracy", result["top1"], None)]
            scores += [(*on, "top-5-accuracy", "top-5 accuracy", result["top5"], None)]
    for key, value in _scores_of(exported.metrics or {}):
        split = "train" if key.startswith("train") else str(data.get("val_split") or "validation")
        scores += [(dataset, split, key, _LABELS.get(key, key), value, None)]
    results = [
        EvalResult(
            task_type=task, dataset_type=on, dataset_name=on, dataset_split=split, metric_type=kind,
            metric_name=label, metric_value=value, metric_config=config,
        )
        for on, split, kind, label, value, config in scores
    ]  # fmt: skip
    tags = ["decentadam", "decentralized-training", task]
    model_type = _model_config(exported).get("model_type")
    tags += [str(model_type)] if model_type else []
    language = [str(data[k]) for k in ("src", "tgt") if data.get(k)] if task == "translation" else None
    card = ModelCardData(
        library_name="transformers", pipeline_tag=task, tags=tags, language=language or None,
        model_name=name, eval_results=results or None,
    )  # fmt: skip
    return str(card.to_yaml())


def model_card(exported: Exported, name: str) -> str:
    """``README.md`` of the exported directory: front matter, then what was trained, how, the scores
    (every number from the run's files) and the commands that load, score and export it."""
    task, data = exported.task, _section(exported, "data")
    architectures = _model_config(exported).get("architectures") or ["model"]
    src, tgt = data.get("src"), data.get("tgt")
    what = f"{src} → {tgt} translation" if src and tgt else task.pipeline_tag
    newest = exported.checkpoints[-1]
    if len(exported.checkpoints) == 1:
        origin = f"checkpoint `{newest}` (step {exported.step})"
    else:
        names = ", ".join(p.name for p in exported.checkpoints)
        origin = f"the mean of {len(exported.checkpoints)} checkpoints of `{exported.run}` ({names})"
    lines = ["---", _card_data(exported, name).rstrip("\n"), "---", "", f"# {name}", ""]
    lines += [
        f"A {', '.join(architectures)} for {what}, trained with decentadam (decentralized data-parallel "
        f"Adam) by its {task.pipeline_tag} recipe. The weights are the consensus (the average over the "
        f"ranks) of {origin}.",
        "",
    ]
    lines += _results(exported)
    lines += _training(exported)
    lines += _use(task, name if REPO_ID.fullmatch(name) else str(exported.out))  # the hub's name, or OUT
    if exported.evals:
        lines += ["## Evaluation", ""]
        for file, result in exported.evals:
            count = result.get("sentences", result.get("images"))
            unit = "sentences" if "sentences" in result else "images"
            command = f"{_eval_command(task, result)} --output {shlex.quote(str(file))}"
            lines += [
                f"`{file.name}` ({count} {unit}) records this evaluation:",
                "",
                "```bash",
                command,
                "```",
                "",
            ]
    lines += ["## Export", "", "```bash", exported.command, "```", ""]
    return "\n".join(lines)


def _model_config(exported: Exported) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((exported.checkpoints[-1] / "config.json").read_text())
    return config


def _results(exported: Exported) -> list[str]:
    """The card's scores: the eval JSONs', then the ``metrics.jsonl`` line of the exported step."""
    task, data, metrics = exported.task, _section(exported, "data"), exported.metrics or {}
    rows = []
    for file, result in exported.evals:
        split = f"{result.get('split')} of `{result.get('data')}`"
        if task.pipeline_tag == "translation":
            for key, label in (("bleu", "BLEU"), ("chrf", "chrF")):
                if key in result:
                    signature = str(result.get(f"{key}_signature")).replace("|", "\\|")  # in a table cell
                    rows.append(
                        f"| {label} | {_number(result[key])} | {split} | `{file.name}`, `{signature}` |"
                    )
        else:
            for key, label in (("top1", "top-1 accuracy"), ("top5", "top-5 accuracy")):
                images = f"{split} ({result.get('images')} images)"
                rows.append(f"| {label} | {100 * float(result[key]):.2f}% | {images} | `{file.name}` |")
    for key, value in _scores_of(metrics):
        shown = f"{100 * value:.2f}%" if key in ("top1", "top5") else _number(value)
        where = "training" if key.startswith("train") else str(data.get("val_split") or "validation")
        rows.append(
            f"| {_LABELS.get(key, key)} | {shown} | {where}, step {exported.step} | `metrics.jsonl` |"
        )
    lines = ["## Results", ""]
    if rows:
        lines += ["| metric | value | split | from |", "|---|---|---|---|", *rows, ""]
    if len(exported.checkpoints) > 1 and metrics:
        lines += [
            f"The `metrics.jsonl` values are the newest checkpoint's (step {exported.step}); the average "
            "was not validated during training.",
            "",
        ]
    if not metrics:
        lines += [f"`{exported.run / 'metrics.jsonl'}` records no evaluation at step {exported.step}.", ""]
    if not exported.evals:
        lines += [_missing_eval(exported)]
    return lines


def _training(exported: Exported) -> list[str]:
    """The card's run: ranks and topology, steps and time (meta.json), data and optimizer (config.toml)."""
    meta, metrics = exported.meta, exported.metrics or {}
    data, optim = _section(exported, "data"), _section(exported, "optim")
    world, topology, local = meta.get("world_size"), meta.get("topology"), meta.get("local_world_size")
    run = f"{world} ranks, topology `{topology}`"
    if isinstance(local, int) and isinstance(world, int) and local > 0:
        run += f", local world size {local} ({world // local} nodes x {local})"
    run += f"; {exported.step} optimizer steps"
    seconds = (meta.get("extra") or {}).get("train_seconds", metrics.get("train_seconds"))
    if isinstance(seconds, int | float):
        run += f", {_duration(float(seconds))} of training (the loop's time without evaluations and saves)"
    lines = [
        "## Training",
        "",
        f"- Run: {run}; from `{checkpoint_files.meta_file(exported.checkpoints[-1])}`.",
    ]
    if (epoch := metrics.get("epoch", metrics.get("epochs"))) is not None:
        lines += [f"- Epoch at step {exported.step}: {_number(epoch)} (`metrics.jsonl`)."]
    if exported.config is None:
        lines += [
            f"- `{exported.run / 'config.toml'}` is missing: the data and the settings are not known.",
            "",
        ]
        return lines
    if data:
        items = [f"`{data.get('path')}`"]
        splits = [f"{k.removesuffix('_split')} `{v}`" for k, v in data.items() if k.endswith("_split") and v]
        items += [f"splits {', '.join(splits)}"] if splits else []
        if exported.task.pipeline_tag == "translation" and data.get("src") and data.get("tgt"):
            items += [f"languages {data['src']} → {data['tgt']}"]
        lines += [f"- Data: {'; '.join(items)}."]
    if optim:
        lines += [f"- Optimizer `{optim.get('optimizer', '?')}`, the `[optim]` section of `config.toml`:", ""]
        lines += ["  | setting | value |", "  |---|---|"]
        lines += [f"  | `{key}` | `{json.dumps(value)}` |" for key, value in optim.items()]
    lines += ["", "<details><summary>The run's config.toml</summary>", "", "```toml"]
    lines += [(exported.config_text or "").rstrip("\n"), "```", "", "</details>", ""]
    return lines


def _use(task: Task, where: str) -> list[str]:
    """The card's lines that load the model from ``where`` (the hub's name or a directory) and run it."""
    if task.pipeline_tag == "translation":
        code = [
            "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
            "",
            f"model = AutoModelForSeq2SeqLM.from_pretrained({where!r})",
            f"tokenizer = AutoTokenizer.from_pretrained({where!r})",
            'batch = tokenizer(["A sentence to translate."], return_tensors="pt")',
            "print(tokenizer.batch_decode(model.generate(**batch, num_beams=4), skip_special_tokens=True))",
        ]
    else:
        code = [
            "from PIL import Image",
            "from transformers import AutoImageProcessor, AutoModelForImageClassification",
            "",
            f"model = AutoModelForImageClassification.from_pretrained({where!r})",
            f"processor = AutoImageProcessor.from_pretrained({where!r})",
            'pixels = processor(images=Image.open("image.png").convert("RGB"), return_tensors="pt")',
            "print(model.config.id2label[int(model(**pixels).logits.argmax())])",
        ]
    return ["## Use", "", "```python", *code, "```", ""]


# ---------------------------------------------------------------------------- the hub


def push(out: Path, repo_id: str, *, private: bool = False, api: Any = None) -> str:
    """Upload the exported ``out`` to the hub repository ``repo_id`` (created if new, ``private``);
    returns its URL. ``api``: an ``huggingface_hub.HfApi`` (a new one by default). OutputError with one
    line when the hub or the network refuses."""
    import huggingface_hub

    if api is None:
        api = huggingface_hub.HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(
            folder_path=str(out), repo_id=repo_id, commit_message="Upload with decentadam-export"
        )
    except Exception as error:  # the hub's (HfHubHTTPError, LocalTokenNotFoundError) or the network's
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = (lines[0] if lines else type(error).__name__)[:300].rstrip(".")
        raise OutputError(
            f"--push-to-hub {repo_id}: {type(error).__name__}: {first}. {out} is exported and "
            f"complete: log in (hf auth login, or HF_TOKEN with a write token) and upload it with `hf upload "
            f"{repo_id} {out}`"
        ) from None
    return str(getattr(url, "url", url))


# ---------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decentadam-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a recipe's run directory or its step-N")
    parser.add_argument("out", metavar="OUT", help="the model directory to write (new or empty)")
    parser.add_argument(
        "--average-last", type=int, default=0, metavar="K",
        help="export the mean of the run's last K checkpoints (default: the newest one)",
    )  # fmt: skip
    parser.add_argument(
        "--eval", action="append", default=[], metavar="EVAL_JSON",
        help="the scores for the card: decentadam-bleu's or decentadam-accuracy's --output of these weights "
        "(default: those found in the run directory); repeatable",
    )  # fmt: skip
    parser.add_argument("--push-to-hub", metavar="OWNER/NAME", help="then upload OUT to this hub repository")
    parser.add_argument("--private", action="store_true", help="create the hub repository private")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    return parser


def main(argv: Sequence[str] | None = None) -> Exported:
    """The command line: export, then push; an EvalError exits with its code and one line."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # no bar among the lines
    try:
        if args.private and not args.push_to_hub:
            raise UsageError(
                "--private makes the hub repository private: it goes with --push-to-hub OWNER/NAME"
            )
        if args.push_to_hub is not None and not REPO_ID.fullmatch(args.push_to_hub):
            raise UsageError(
                f"--push-to-hub {args.push_to_hub!r}: expected OWNER/NAME, e.g. me/m30k-en-de-aer"
            )
        exported = export(
            args.source, args.out, average_last=args.average_last, evals=args.eval, overwrite=args.overwrite,
            push_to_hub=args.push_to_hub, private=args.private,
        )  # fmt: skip
        print(f"exported {', '.join(str(c) for c in exported.checkpoints)} to {exported.out}")
        if args.push_to_hub:
            print(f"pushed to {push(exported.out, args.push_to_hub, private=args.private)}")
    except EvalError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    return exported


def run() -> None:
    """``decentadam-export`` (``python -m recipes.export``)."""
    main()


if __name__ == "__main__":
    run()
