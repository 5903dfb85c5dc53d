"""sacreBLEU (and chrF) of a Hugging Face seq2seq checkpoint on a parallel test set.

::

    python -m eval.bleu runs/m30k/step-3000 --data DATA/multi30k --split test_2016_flickr --src en --tgt de
    python -m eval.bleu runs/m30k --average-last 5 --data DATA/multi30k --split test_2016_flickr \\
        --src en --tgt de --output runs/m30k/test.json      # the mean of the run's last 5 checkpoints

``CHECKPOINT`` is any directory that ``AutoModelForSeq2SeqLM`` and ``AutoTokenizer`` load with
``from_pretrained`` (this project's recipes write them; a public Marian model works too). The test
set is read by the translation recipe's own reader (``recipes.translation.data.read_split``), so
``--data`` takes what training's ``data=`` takes: a directory of ``{split}.{src}`` and
``{split}.{tgt}`` files (optionally gzipped, one sentence per line, aligned); a local ``datasets``
directory with a ``translation`` column (``save_to_disk``'s, or parquet files in the hub's layout,
``DIR/de-en/test-00000-of-00001.parquet``); or a hub corpus (``wmt/wmt14``)::

    python -m eval.bleu runs/wmt/step-100000 --data wmt/wmt14 --split test --src en --tgt de

``--split`` defaults to the run's ``data.test_split`` (the ``config.toml`` of the run directory that
holds the checkpoint), else to the only ``test*`` split of a directory of files, else to ``test``
(the hub's name); a directory with several ``test*`` splits, or none, needs ``--split``, and a split
that is missing is reported with the splits there are.

Decoding: beam search (beam 4, length penalty 0.6 by default, the paper's settings), at most
``source length + 50`` new tokens (the longest source of the batch: sentences are sorted by length
and batched by ``--max-tokens`` of beams x source tokens), under ``torch.inference_mode``. The
detokenized hypotheses are scored with sacreBLEU's corpus BLEU (``--tokenize``: 13a by default,
any of sacreBLEU's tokenizations; mixed case) and chrF against the raw references. The result
(scores, sacreBLEU's signatures, settings) is printed as JSON on stdout and written to
``--output``; sacreBLEU's own lines go to stderr. ``--hypotheses FILE`` also writes the
translations, one per line in the input order. Exit codes: ``eval.contract``.

``--score HYPOTHESES_FILE`` scores a file of translations (one per line, in the split's order:
what ``--hypotheses`` writes) instead of a checkpoint's; ``--compare OTHER_HYPOTHESES`` adds
sacreBLEU's paired bootstrap resampling (1,000 samples) against those, the baseline: each system's
BLEU and chrF with the bootstrap mean, the 95% confidence interval and the p-value, in the JSON's
``compare``::

    python -m eval.bleu runs/m30k-aer --average-last 1 --data DATA/multi30k --src en --tgt de \\
        --hypotheses aer.txt --compare allreduce.txt
    python -m eval.bleu --score aer.txt --data DATA/multi30k --src en --tgt de --compare allreduce.txt

A checkpoint that does not load (no ``config.json``, no weights, a ``pytorch_model.bin`` that
``torch.load`` refuses to unpickle, a model type transformers does not know) is exit code 4 with one
line naming the file; a run directory given without ``--average-last`` says to pass it.

``--average-last K`` takes a run directory instead: its last K complete checkpoints (``step-N``
or ``checkpoint-N`` directories with decentadam's metadata, ``recipes.common.run.list_checkpoints``)
are loaded and their floating-point parameters averaged before decoding (fairseq's
``average_checkpoints``).
"""

from __future__ import annotations

if not __package__:  # run as a file, `eval` would not be a package
    raise SystemExit(
        f"{__file__} is a module of the eval package: run python -m eval.bleu from the repository root"
    )

import argparse
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eval.contract import CheckpointError, DataError, UsageError, main
from recipes.common.run import list_checkpoints
from recipes.translation.data import DataError as TextError
from recipes.translation.data import local_splits, read_split

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "BEAM", "LENGTH_PENALTY", "MAX_LEN_B", "MAX_TOKENS", "default_split", "evaluate", "load_averaged",
    "load_model",
    "paired_bootstrap", "read_hypotheses", "score", "translate",
]  # fmt: skip

# Decoding defaults (the paper's beam and length penalty), shared by the CLI, ``evaluate`` and
# ``translate``'s other callers (benchmarks.parity.workers --bleu) so that every BLEU decodes alike.
BEAM = 4
LENGTH_PENALTY = 0.6
MAX_LEN_B = 50  # at most source length + this many new tokens
MAX_TOKENS = 16000  # beams x source tokens per batch
TOKENIZE = "13a"  # sacreBLEU's default tokenization (WMT's mteval-v13a)
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The weights files ``from_pretrained`` reads, in its order of preference."""


def load_model(checkpoint: Path, average_last: int, dtype: torch.dtype) -> tuple[Any, Any, list[Path]]:
    """(model, tokenizer, checkpoints used); with ``average_last`` the mean of the last K checkpoints.

    Every way a checkpoint fails to load raises :class:`CheckpointError` with one line naming the
    file (:func:`load_averaged`, and the same for the tokenizer).
    """
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model, paths = load_averaged(checkpoint, average_last, AutoModelForSeq2SeqLM)
    with _loading(paths[-1], "the tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(paths[-1])
    return model.to(dtype).eval(), tokenizer, paths


def load_averaged(checkpoint: Path, average_last: int, auto_class: Any) -> tuple[Any, list[Path]]:
    """(float32 model, checkpoints used): ``auto_class.from_pretrained(checkpoint)``, or with
    ``average_last`` > 0 the mean of the floating-point weights of the last K complete checkpoints of
    the run directory ``checkpoint`` (fairseq's ``average_checkpoints``); ``decentadam-export``
    averages with it too.

    Every way a checkpoint fails to load (not a ``from_pretrained`` directory, a run directory
    without ``--average-last``, no weights, a pickle that ``torch.load`` refuses, a model type
    transformers does not know) raises :class:`CheckpointError` with one line naming the file.
    """
    paths = [checkpoint]
    if average_last > 0:
        paths = list_checkpoints(checkpoint)[-average_last:]
        if not paths:
            raise CheckpointError(
                f"{checkpoint} holds no complete checkpoint (a subdirectory step-N with "
                "decentadam/meta.json): give a recipe's run directory, or drop --average-last"
            )
    for path in paths:
        if path.exists():
            _check_directory(path)
        elif not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(path)):  # else a hub name, for from_pretrained
            raise CheckpointError(
                f"{path} does not exist: give a checkpoint directory, a run directory with --average-last K "
                "or a hub name (owner/name)"
            )

    def weights(path: Path) -> dict[str, torch.Tensor]:
        with _loading(path, "the model"):
            return dict(auto_class.from_pretrained(path, dtype=torch.float32).state_dict())

    with _loading(paths[-1], "the model"):
        model = auto_class.from_pretrained(paths[-1], dtype=torch.float32)
    if len(paths) > 1:
        total = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        for path in paths[:-1]:
            other = weights(path)
            for key in total:
                total[key] += other[key]
        model.load_state_dict({k: v / len(paths) for k, v in total.items()}, strict=False)
    return model, paths


def _check_directory(path: Path) -> None:
    """Raise CheckpointError unless ``path`` holds a config and weights that ``from_pretrained`` reads."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file: give a directory that from_pretrained loads")
    if not (path / "config.json").is_file():
        runs = list_checkpoints(path)
        if runs:
            raise CheckpointError(
                f"{path} is a run directory ({len(runs)} checkpoints, the newest {runs[-1].name}), not a "
                f"checkpoint: pass --average-last 1 for its newest checkpoint (--average-last K averages the "
                f"last K), or give a checkpoint such as {runs[-1]}"
            )
        raise CheckpointError(
            f"{path / 'config.json'} does not exist: expected a directory that from_pretrained loads "
            "(config.json, the weights, the tokenizer)"
        )
    if not any((path / name).is_file() for name in WEIGHTS):
        raise CheckpointError(
            f"{path}: no weights beside config.json (expected {' or '.join(WEIGHTS[::2])}); an interrupted "
            "save leaves none"
        )


class _loading:
    """Turns what ``from_pretrained`` raises for ``path`` into a one-line CheckpointError naming the
    file: the weights file for a refused pickle, config.json for an unknown model type."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: Any) -> None:
        if error is None:
            return
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        if isinstance(error, pickle.UnpicklingError):
            weights = next((self.path / n for n in WEIGHTS if (self.path / n).is_file()), self.path)
            reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
            raise CheckpointError(
                f"{weights}: torch.load refused to unpickle it ({reason}); a pickle can run code: load a "
                "model.safetensors, or convert a copy you trust"
            ) from None
        if not isinstance(error, (OSError, ValueError, KeyError, RuntimeError)):
            return  # not the checkpoint's fault: a bug, with its traceback (exit code 1)
        first = lines[0] if lines else type(error).__name__
        if "model type" in first or "Unrecognized model" in first:
            raise CheckpointError(f"{self.path / 'config.json'}: {first}") from None
        raise CheckpointError(
            f"{self.path}: {self.what} is not one that from_pretrained loads ({first[:300]})"
        ) from None


def translate(
    model: Any,
    tokenizer: Any,
    sources: list[str],
    *,
    beam: int = BEAM,
    length_penalty: float = LENGTH_PENALTY,
    max_len_b: int = MAX_LEN_B,
    max_tokens: int = MAX_TOKENS,
    device: str,
) -> list[str]:
    """Hypotheses in the order of ``sources``: sorted by length, batched by beams x tokens, beam search."""
    encoded = tokenizer(sources, add_special_tokens=True)["input_ids"]
    order = sorted(range(len(sources)), key=lambda i: len(encoded[i]))
    hypotheses = [""] * len(sources)
    batches: list[list[int]] = [[]]
    for index in order:  # lengths grow along `order`: this sentence is the longest of its batch so far
        if batches[-1] and beam * len(encoded[index]) * (len(batches[-1]) + 1) > max_tokens:
            batches.append([])
        batches[-1].append(index)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.inference_mode():
        for batch in batches:
            longest = max(len(encoded[i]) for i in batch)
            input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)  # (B, S)
            attention_mask = torch.zeros_like(input_ids)
            for row, i in enumerate(batch):
                input_ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
                attention_mask[row, : len(encoded[i])] = 1
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                num_beams=beam,
                length_penalty=length_penalty,
                max_new_tokens=longest + max_len_b,
                max_length=None,
                early_stopping=True,
                do_sample=False,
            )  # (B, T)
            texts = tokenizer.batch_decode(
                output, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
            for i, text in zip(batch, texts, strict=True):
                hypotheses[i] = text.strip()
    return hypotheses


def score(hypotheses: list[str], references: list[str], tokenize: str = TOKENIZE) -> dict[str, Any]:
    """sacreBLEU corpus BLEU (``tokenize``: one of ``sacrebleu.BLEU.TOKENIZERS``) and chrF with their
    signatures."""
    from sacrebleu import BLEU, CHRF

    bleu, chrf = BLEU(tokenize=tokenize), CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(bleu_score.score, 2),
        "chrf": round(chrf_score.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_detail": str(bleu_score),
        "chrf_detail": str(chrf_score),
    }


def paired_bootstrap(
    hypotheses: list[str], other: list[str], references: list[str], tokenize: str = TOKENIZE
) -> dict[str, Any]:
    """sacreBLEU's paired bootstrap resampling (1,000 samples, its seed 12345 unless SACREBLEU_SEED
    says otherwise) of ``hypotheses`` against the baseline ``other``: each system's BLEU and chrF with
    the bootstrap mean and 95% confidence interval, and the p-value of the difference."""
    from sacrebleu import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    test = PairedTest(
        [("other", other), ("this", hypotheses)], {"BLEU": BLEU(tokenize=tokenize), "chrF": CHRF()},
        [references], test_type="bs",
    )  # fmt: skip
    signatures, scores = test()
    result: dict[str, Any] = {}
    for metric in ("BLEU", "chrF"):
        name = next(k for k in scores if k.startswith(metric))
        baseline, system = (_bootstrapped(r) for r in scores[name])
        result[metric.lower()] = {
            "this": system["score"], "this_mean": system["mean"], "this_ci": system["ci"],
            "other": baseline["score"], "other_mean": baseline["mean"], "other_ci": baseline["ci"],
            "p_value": system["p_value"], "signature": str(signatures[name]),
        }  # fmt: skip
    return result


def _bootstrapped(result: Any) -> dict[str, float | None]:
    """A sacreBLEU significance Result's numbers, rounded as the scores are (None where absent)."""
    numbers = {k: getattr(result, k) for k in ("score", "mean", "ci", "p_value")}
    return {k: v if v is None or k == "p_value" else round(float(v), 2) for k, v in numbers.items()}


def read_hypotheses(path: str | Path, expected: int, flag: str) -> list[str]:
    """The lines of the hypotheses file ``path`` (``flag``: the option that gave it), one per
    reference; DataError for a file that is missing, unreadable or of another length."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(
            f"{flag} {path}: cannot read it ({error}); expected UTF-8 text, one line per sentence"
        ) from None
    if len(lines) != expected:
        raise DataError(
            f"{flag} {path} has {len(lines)} lines but the test set has {expected} sentences: expected one "
            "hypothesis per line, in the test set's order (what --hypotheses writes)"
        )
    return lines


def default_split(checkpoint: Path | None, average_last: int, data: str, src: str, tgt: str) -> str:
    """The split to score when ``--split`` is not given: the run's ``data.test_split`` (its
    ``config.toml``: the run directory with ``average_last``, else the checkpoint's parent), else the
    only ``test*`` split of a directory of files, else ``test`` (the hub's name); DataError listing
    the splits when a directory of files has none or several."""
    if checkpoint is not None:
        run = checkpoint if average_last > 0 else checkpoint.parent
        if (run / "config.toml").is_file():
            try:
                split = tomllib.loads((run / "config.toml").read_text()).get("data", {}).get("test_split")
            except tomllib.TOMLDecodeError:
                split = None
            if isinstance(split, str) and split:
                return str(split)
    splits = local_splits(data)
    if splits is None:
        return "test"
    tests = [split for split in splits if split.startswith("test")]
    if len(tests) == 1:
        return tests[0]
    raise DataError(
        f"no --split given and {data} has {'several test splits' if tests else 'no test* split'} "
        f"({', '.join(splits) or 'no split.lang files'}): pass --split NAME"
    )


def evaluate(
    checkpoint: str | Path | None,
    data: str,
    split: str | None,
    src: str,
    tgt: str,
    *,
    beam: int = BEAM,
    length_penalty: float = LENGTH_PENALTY,
    max_len_b: int = MAX_LEN_B,
    max_tokens: int = MAX_TOKENS,
    average_last: int = 0,
    prefix: str = "",
    limit: int = 0,
    device: str = "auto",
    dtype: str = "float32",
    hypotheses: str | Path | None = None,
    tokenize: str = TOKENIZE,
    score_file: str | Path | None = None,
    compare: str | Path | None = None,
) -> dict[str, Any]:
    """BLEU and chrF of ``checkpoint`` (a run directory with ``average_last``) on ``split`` of ``data``
    (None: :func:`default_split`), or of the translations in ``score_file`` (``checkpoint`` None);
    with ``compare``, the paired bootstrap against the translations in that file.

    Raises :class:`eval.contract.DataError` for the test set and the hypotheses files and
    ``CheckpointError`` for the model.
    """
    started = time.perf_counter()
    if (checkpoint is None) == (score_file is None):
        raise ValueError("evaluate: give a checkpoint or score_file, not both")
    model_dir = None if checkpoint is None else Path(checkpoint)
    split = split or default_split(model_dir, average_last, data, src, tgt)
    try:
        sources, references = read_split(data, split, src, tgt, limit)
    except (TextError, ImportError) as error:
        raise DataError(str(error)) from None
    other = read_hypotheses(compare, len(references), "--compare") if compare is not None else None
    used: list[Path] = []
    decoding: dict[str, Any] = {}
    if model_dir is None:
        translations = read_hypotheses(score_file or "", len(references), "--score")
    else:
        run_on = device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer, used = load_model(model_dir, average_last, getattr(torch, dtype))
        model.to(run_on)
        begin = time.perf_counter()
        translations = translate(
            model, tokenizer, [prefix + s for s in sources], beam=beam, length_penalty=length_penalty,
            max_len_b=max_len_b, max_tokens=max_tokens, device=run_on,
        )  # fmt: skip
        decoding = {
            "beam": beam,
            "length_penalty": length_penalty,
            "max_len_b": max_len_b,
            "decode_seconds": round(time.perf_counter() - begin, 1),
        }
        if hypotheses is not None:
            Path(hypotheses).parent.mkdir(parents=True, exist_ok=True)
            Path(hypotheses).write_text("".join(h + "\n" for h in translations), encoding="utf-8")
    result = {
        **score(translations, references, tokenize),
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "checkpoints": [str(p) for p in used],
        "scored": str(score_file) if score_file is not None else None,
        "data": data,
        "split": split,
        "src": src,
        "tgt": tgt,
        "sentences": len(sources),
        **decoding,
        "hypotheses": str(hypotheses) if hypotheses is not None and model_dir is not None else None,
    }
    if other is not None:
        result["compare"] = {
            "other": str(compare),
            **paired_bootstrap(translations, other, references, tokenize),
        }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def parser() -> argparse.ArgumentParser:
    from sacrebleu import BLEU

    parser = argparse.ArgumentParser(
        prog="python -m eval.bleu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "checkpoint", nargs="?", help="a from_pretrained directory, or a run directory with --average-last"
    )
    parser.add_argument("--data", required=True, help="{split}.{lang}[.gz] files, datasets dir or wmt/wmt14")
    parser.add_argument(
        "--split",
        help="split to translate (default: the run's data.test_split from its config.toml, else the data's "
        "only test* split, else test)",
    )
    parser.add_argument("--src", required=True, help="source language suffix, e.g. en")
    parser.add_argument("--tgt", required=True, help="target language suffix, e.g. de")
    parser.add_argument(
        "--tokenize", choices=sorted(BLEU.TOKENIZERS), default=TOKENIZE,
        help=f"sacreBLEU's tokenization for BLEU (default {TOKENIZE}; zh, ja-mecab, flores200, ...)",
    )  # fmt: skip
    parser.add_argument(
        "--score", metavar="HYPOTHESES_FILE",
        help="score these translations (one per line, in the split's order) instead of a checkpoint's",
    )  # fmt: skip
    parser.add_argument(
        "--compare", metavar="OTHER_HYPOTHESES",
        help="also run sacreBLEU's paired bootstrap against these translations (the baseline)",
    )  # fmt: skip
    parser.add_argument("--beam", type=int, default=BEAM, help=f"beam size (default {BEAM})")
    parser.add_argument(
        "--length-penalty", type=float, default=LENGTH_PENALTY,
        help=f"score / length**lp (default {LENGTH_PENALTY})",
    )  # fmt: skip
    parser.add_argument(
        "--max-len-b", type=int, default=MAX_LEN_B,
        help=f"at most source length + this many new tokens (default {MAX_LEN_B})",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS,
        help=f"beams x source tokens per batch (default {MAX_TOKENS})",
    )  # fmt: skip
    parser.add_argument(
        "--average-last", type=int, default=0, metavar="K", help="average the run's last K checkpoints"
    )
    parser.add_argument("--prefix", default="", help="text put before every source (e.g. T5's task prefix)")
    parser.add_argument("--limit", type=int, default=0, help="translate the first N sentences only")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--output", help="also write the JSON result to this file")
    parser.add_argument("--hypotheses", help="write the translations to this file, one per line")
    return parser


def _evaluate(args: argparse.Namespace) -> dict[str, Any]:
    if (args.checkpoint is None) == (args.score is None):
        raise UsageError(
            "give a CHECKPOINT to translate or --score HYPOTHESES_FILE to score a file of translations, "
            "not both"
            if args.checkpoint
            else "give a CHECKPOINT (or a run directory with --average-last K) or --score HYPOTHESES_FILE"
        )
    if args.score is not None and (args.average_last or args.hypotheses):
        raise UsageError(
            "--score scores a file of translations: --average-last and --hypotheses need a CHECKPOINT"
        )
    return evaluate(
        args.checkpoint, args.data, args.split, args.src, args.tgt, beam=args.beam,
        length_penalty=args.length_penalty, max_len_b=args.max_len_b, max_tokens=args.max_tokens,
        average_last=args.average_last, prefix=args.prefix, limit=args.limit, device=args.device,
        dtype=args.dtype, hypotheses=args.hypotheses, tokenize=args.tokenize, score_file=args.score,
        compare=args.compare,
    )  # fmt: skip


def _summary(result: dict[str, Any]) -> str:
    """sacreBLEU's lines, ``NAME|signature = score ...``, and where the result came from."""
    lines = []
    for metric in ("bleu", "chrf"):
        name, value = result[f"{metric}_detail"].split(" = ", 1)
        lines.append(f"{name}|{result[f'{metric}_signature']} = {value}")
    if "decode_seconds" in result:
        lines.append(f"{result['sentences']} sentences in {result['decode_seconds']} s")
    else:
        lines.append(f"{result['sentences']} sentences of {result['scored']}")
    for metric, name in (("bleu", "BLEU"), ("chrf", "chrF")):
        if (paired := result.get("compare", {}).get(metric)) is not None:
            lines.append(
                f"{name} {paired['this']} ({paired['this_mean']} +- {paired['this_ci']}) against "
                f"{paired['other']} ({paired['other_mean']} +- {paired['other_ci']}) of "
                f"{result['compare']['other']}: p = {paired['p_value']:.4f} (paired bootstrap, "
                f"{paired['signature']})"
            )
    return "\n".join(lines)


def run() -> None:
    """The command line: ``python -m eval.bleu``, or ``decentadam-bleu`` once installed."""
    main(parser(), _evaluate, summary=_summary)


if __name__ == "__main__":
    run()
