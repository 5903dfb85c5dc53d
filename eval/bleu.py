"""sacreBLEU (and chrF) of a Hugging Face seq2seq checkpoint on a parallel test set.

::

    python eval/bleu.py runs/m30k/step-0003000 --data ../shared/data/multi30k \\
        --split test_2016_flickr --src en --tgt de
    python eval/bleu.py runs/m30k --average-last 5 --data ../shared/data/multi30k --split test_2016_flickr \\
        --src en --tgt de                     # the mean of the run's last 5 checkpoints' weights

``CHECKPOINT_DIR`` is any directory that ``AutoModelForSeq2SeqLM`` and ``AutoTokenizer`` load with
``from_pretrained`` (this project's recipes write them; a public Marian model works too). The test
set is ``DATA/{split}.{src}`` and ``DATA/{split}.{tgt}``, optionally gzipped, one sentence per line.

Decoding: beam search (beam 4, length penalty 0.6 by default, the paper's settings), at most
``source length + 50`` new tokens (the longest source of the batch: sentences are sorted by length
and batched by ``--max-tokens`` of beams x source tokens), under ``torch.inference_mode``. The
detokenized hypotheses are scored with sacreBLEU's corpus BLEU (13a tokenization, mixed case) and
chrF against the raw references, and printed with sacreBLEU's signatures. Hypotheses go to
``--output`` (default ``CHECKPOINT_DIR/{split}.{src}-{tgt}.hyp``), one per line in the input
order, and the scores to ``--json`` (default: the same path with ``.json``).

``--average-last K`` takes a run directory instead: its last K checkpoints (subdirectories named
``...-N`` with a ``config.json``, ordered by N) are loaded and their floating-point parameters
averaged before decoding (fairseq's ``average_checkpoints``); outputs then go to the run directory.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "checkpoint", help="a from_pretrained directory, or a run directory with --average-last"
    )
    parser.add_argument("--data", required=True, help="directory of {split}.{lang}[.gz] files")
    parser.add_argument("--split", default="test", help="split to translate (default: test)")
    parser.add_argument("--src", required=True, help="source language suffix, e.g. en")
    parser.add_argument("--tgt", required=True, help="target language suffix, e.g. de")
    parser.add_argument("--beam", type=int, default=4, help="beam size (default 4)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="score / length**lp (default 0.6)")
    parser.add_argument("--max-len-b", type=int, default=50, help="at most source length + this new tokens")
    parser.add_argument("--max-tokens", type=int, default=16000, help="beams x source tokens per batch")
    parser.add_argument(
        "--average-last", type=int, default=0, metavar="K", help="average the run's last K checkpoints"
    )
    parser.add_argument("--prefix", default="", help="text put before every source (e.g. T5's task prefix)")
    parser.add_argument("--limit", type=int, default=0, help="translate the first N sentences only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--output", help="hypotheses file (default: next to the checkpoint)")
    parser.add_argument("--json", help="scores file (default: the hypotheses path with .json)")
    return parser.parse_args(argv)


def read_lines(directory: Path, split: str, lang: str) -> list[str]:
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        path = directory / name
        if path.is_file():
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as handle:
                return [line.rstrip("\n") for line in handle]
    raise FileNotFoundError(f"no {directory / f'{split}.{lang}'} (or .gz): expected one sentence per line")


def run_checkpoints(run: Path) -> list[Path]:
    """Subdirectories of ``run`` that hold a model (``config.json``), ordered by their trailing number."""
    found = []
    for path in run.iterdir() if run.is_dir() else []:
        match = re.search(r"(\d+)$", path.name)
        if path.is_dir() and match and (path / "config.json").is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def load_model(checkpoint: Path, average_last: int, dtype: torch.dtype) -> tuple[Any, Any, list[Path]]:
    """(model, tokenizer, checkpoints used); with ``average_last`` the mean of the last K checkpoints."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    paths = [checkpoint]
    if average_last > 0:
        paths = run_checkpoints(checkpoint)[-average_last:]
        if not paths:
            raise FileNotFoundError(
                f"{checkpoint} holds no checkpoint (a subdirectory step-N with a config.json)"
            )
    model = AutoModelForSeq2SeqLM.from_pretrained(paths[-1], dtype=torch.float32)
    if len(paths) > 1:
        total = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        for path in paths[:-1]:
            other = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).state_dict()
            for key in total:
                total[key] += other[key]
        model.load_state_dict({k: v / len(paths) for k, v in total.items()}, strict=False)
    tokenizer = AutoTokenizer.from_pretrained(paths[-1])
    return model.to(dtype).eval(), tokenizer, paths


def translate(
    model: Any,
    tokenizer: Any,
    sources: list[str],
    *,
    beam: int,
    length_penalty: float,
    max_len_b: int,
    max_tokens: int,
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    checkpoint, data = Path(args.checkpoint), Path(args.data)
    sources, references = read_lines(data, args.split, args.src), read_lines(data, args.split, args.tgt)
    if len(sources) != len(references):
        raise ValueError(
            f"{args.split}.{args.src} has {len(sources)} lines but {args.split}.{args.tgt} {len(references)}"
        )
    if args.limit > 0:
        sources, references = sources[: args.limit], references[: args.limit]
    dtype = getattr(torch, args.dtype)
    model, tokenizer, used = load_model(checkpoint, args.average_last, dtype)
    model.to(args.device)
    begin = time.perf_counter()
    hypotheses = translate(
        model,
        tokenizer,
        [args.prefix + s for s in sources],
        beam=args.beam,
        length_penalty=args.length_penalty,
        max_len_b=args.max_len_b,
        max_tokens=args.max_tokens,
        device=args.device,
    )
    seconds = time.perf_counter() - begin
    scores = score(hypotheses, references)
    output = Path(args.output) if args.output else checkpoint / f"{args.split}.{args.src}-{args.tgt}.hyp"
    json_path = Path(args.json) if args.json else output.with_suffix(".json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    result = {
        **scores,
        "checkpoints": [str(p) for p in used],
        "split": args.split,
        "src": args.src,
        "tgt": args.tgt,
        "sentences": len(sources),
        "beam": args.beam,
        "length_penalty": args.length_penalty,
        "max_len_b": args.max_len_b,
        "decode_seconds": round(seconds, 1),
        "hypotheses": str(output),
    }
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    for metric in ("bleu", "chrf"):  # as the sacrebleu command prints it: NAME|signature = score ...
        name, value = scores[f"{metric}_detail"].split(" = ", 1)
        print(f"{name}|{scores[f'{metric}_signature']} = {value}")
    print(f"{len(sources)} sentences in {seconds:.1f} s; hypotheses: {output}; scores: {json_path}")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    try:
        main()
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: {error}")
