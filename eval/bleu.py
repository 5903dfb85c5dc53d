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

Decoding: beam search (beam 4, length penalty 0.6 by default, the paper's settings), at most
``source length + 50`` new tokens (the longest source of the batch: sentences are sorted by length
and batched by ``--max-tokens`` of beams x source tokens), under ``torch.inference_mode``. The
detokenized hypotheses are scored with sacreBLEU's corpus BLEU (13a tokenization, mixed case) and
chrF against the raw references. The result (scores, sacreBLEU's signatures, settings) is printed as
JSON on stdout and written to ``--output``; sacreBLEU's own lines go to stderr. ``--hypotheses
FILE`` also writes the translations, one per line in the input order. Exit codes: ``eval.contract``.

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
import time
from pathlib import Path
from typing import Any

import torch

from eval.contract import CheckpointError, DataError, main
from recipes.common.run import list_checkpoints
from recipes.translation.data import DataError as TextError
from recipes.translation.data import read_split

__all__ = [
    "BEAM", "LENGTH_PENALTY", "MAX_LEN_B", "MAX_TOKENS", "evaluate", "load_model", "score", "translate",
]  # fmt: skip

# Decoding defaults (the paper's beam and length penalty), shared by the CLI, ``evaluate`` and
# ``translate``'s other callers (benchmarks.parity.workers --bleu) so that every BLEU decodes alike.
BEAM = 4
LENGTH_PENALTY = 0.6
MAX_LEN_B = 50  # at most source length + this many new tokens
MAX_TOKENS = 16000  # beams x source tokens per batch


def load_model(checkpoint: Path, average_last: int, dtype: torch.dtype) -> tuple[Any, Any, list[Path]]:
    """(model, tokenizer, checkpoints used); with ``average_last`` the mean of the last K checkpoints."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    paths = [checkpoint]
    if average_last > 0:
        paths = list_checkpoints(checkpoint)[-average_last:]
        if not paths:
            raise CheckpointError(
                f"{checkpoint} holds no complete checkpoint (a subdirectory step-N with "
                "decentadam/meta.json): give a recipe's run directory, or drop --average-last"
            )
    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(paths[-1], dtype=torch.float32)
        if len(paths) > 1:
            total = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
            for path in paths[:-1]:
                other = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).state_dict()
                for key in total:
                    total[key] += other[key]
            model.load_state_dict({k: v / len(paths) for k, v in total.items()}, strict=False)
        tokenizer = AutoTokenizer.from_pretrained(paths[-1])
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{paths[-1]}: not a seq2seq checkpoint that from_pretrained loads ({error})"
        ) from None
    return model.to(dtype).eval(), tokenizer, paths


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


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """sacreBLEU corpus BLEU and chrF with their signatures."""
    from sacrebleu import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
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


def evaluate(
    checkpoint: str | Path,
    data: str,
    split: str,
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
) -> dict[str, Any]:
    """BLEU and chrF of ``checkpoint`` (a run directory with ``average_last``) on ``split`` of ``data``.

    Raises :class:`eval.contract.DataError` for the test set and ``CheckpointError`` for the model.
    """
    started = time.perf_counter()
    try:
        sources, references = read_split(data, split, src, tgt, limit)
    except (TextError, ImportError) as error:
        raise DataError(str(error)) from None
    run_on = device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, used = load_model(Path(checkpoint), average_last, getattr(torch, dtype))
    model.to(run_on)
    begin = time.perf_counter()
    translations = translate(
        model, tokenizer, [prefix + s for s in sources], beam=beam, length_penalty=length_penalty,
        max_len_b=max_len_b, max_tokens=max_tokens, device=run_on,
    )  # fmt: skip
    decode_seconds = time.perf_counter() - begin
    if hypotheses is not None:
        Path(hypotheses).parent.mkdir(parents=True, exist_ok=True)
        Path(hypotheses).write_text("".join(h + "\n" for h in translations), encoding="utf-8")
    return {
        **score(translations, references),
        "checkpoint": str(checkpoint),
        "checkpoints": [str(p) for p in used],
        "data": data,
        "split": split,
        "src": src,
        "tgt": tgt,
        "sentences": len(sources),
        "beam": beam,
        "length_penalty": length_penalty,
        "max_len_b": max_len_b,
        "decode_seconds": round(decode_seconds, 1),
        "hypotheses": str(hypotheses) if hypotheses is not None else None,
        "seconds": round(time.perf_counter() - started, 1),
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eval.bleu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "checkpoint", help="a from_pretrained directory, or a run directory with --average-last"
    )
    parser.add_argument("--data", required=True, help="{split}.{lang}[.gz] files, datasets dir or wmt/wmt14")
    parser.add_argument("--split", default="test", help="split to translate (default: test)")
    parser.add_argument("--src", required=True, help="source language suffix, e.g. en")
    parser.add_argument("--tgt", required=True, help="target language suffix, e.g. de")
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
    return evaluate(
        args.checkpoint, args.data, args.split, args.src, args.tgt, beam=args.beam,
        length_penalty=args.length_penalty, max_len_b=args.max_len_b, max_tokens=args.max_tokens,
        average_last=args.average_last, prefix=args.prefix, limit=args.limit, device=args.device,
        dtype=args.dtype, hypotheses=args.hypotheses,
    )  # fmt: skip


def _summary(result: dict[str, Any]) -> str:
    """sacreBLEU's lines, ``NAME|signature = score ...``, and where the result came from."""
    lines = []
    for metric in ("bleu", "chrf"):
        name, value = result[f"{metric}_detail"].split(" = ", 1)
        lines.append(f"{name}|{result[f'{metric}_signature']} = {value}")
    lines.append(f"{result['sentences']} sentences in {result['decode_seconds']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main(parser(), _evaluate, summary=_summary)
