"""A generated English-German parallel corpus the size and shape of WMT14 En-De, for data-pipeline
measurements (issue 23: time to the first training step and memory per rank at WMT scale).

The text is not language, but it has the statistics that cost time and memory in reading,
tokenizer training and encoding:

- sentence lengths: English words per sentence from a lognormal with mean 23 and a long tail
  (WMT14 En-De's training text has a mean of about 23 words and sentences past 100 words), clipped
  to 1..250 words; the German side has the English length times a lognormal ratio around 0.95;
- vocabulary: 200,000 words per language with Zipfian frequencies (exponent 1.0, rank offset 2.7),
  each word spelled from syllables (base-S digits of its rank over a shuffled syllable inventory,
  so frequent words are short and BPE has shared pieces to learn), plus ``,`` and ``.``;
- alignment: the German words of a pair are a fixed permutation of the English ones (then padded
  or cut to the German length), so a model could learn something, and a line's two sides are related.

::

    python -m benchmarks.wmt_corpus --out DIR --pairs 4500000 --seed 0

writes ``DIR/{train,val,test}.{en,de}.gz`` (``--plain`` for uncompressed files), the layout that
``recipes.translation.data.read_local`` reads; val and test have 3,000 pairs each (newstest's size).
Everything is vectorised in numpy and written in chunks, so 4.5M pairs take a few minutes and
little memory.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np

logger = logging.getLogger(__name__)

VOCABULARY = 200_000
MEAN_WORDS = 23.0
SIGMA = 0.6  # of log(words): a tail past 100 words, as WMT14 has
MAX_WORDS = 250
ZIPF_EXPONENT, ZIPF_OFFSET = 1.0, 2.7
CHUNK = 100_000  # pairs generated and written at a time
ONSETS = {
    "en": ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "w", "th", "st", "ch"],
    "de": ["", "b", "d", "f", "g", "h", "k", "l", "m", "n", "r", "s", "t", "w", "z", "sch", "st", "pf"],
}
NUCLEI = {
    "en": ["a", "e", "i", "o", "u", "ea", "ou", "y"],
    "de": ["a", "e", "i", "o", "u", "ei", "au", "ü", "ä", "ie"],
}
CODAS = {"en": ["", "n", "s", "t", "r", "ng"], "de": ["", "n", "r", "t", "ch", "s"]}


def syllables(lang: str, rng: np.random.Generator) -> list[str]:
    """The syllable inventory of ``lang`` (onset + nucleus + coda), shuffled by ``rng``."""
    found = sorted({o + n + c for o in ONSETS[lang] for n in NUCLEI[lang] for c in CODAS[lang]})
    return [found[i] for i in rng.permutation(len(found))]


def lexicon(lang: str, size: int, rng: np.random.Generator) -> list[str]:
    """``size`` distinct words, most frequent first: ``,`` ``.`` then the base-S spelling of each rank."""
    inventory = syllables(lang, rng)
    base = len(inventory)
    words = [",", "."]
    for rank in range(size - 2):
        spelled, value = [], rank
        while True:
            spelled.append(inventory[value % base])
            value //= base
            if value == 0:
                break
            value -= 1  # bijective numeration: every rank a distinct spelling
        words.append("".join(reversed(spelled)))
    return words


def packed(words: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The words as one UTF-8 byte array with their starts and lengths."""
    encoded = [w.encode() for w in words]
    lengths = np.array([len(w) for w in encoded], dtype=np.int64)
    starts = np.zeros(len(encoded), dtype=np.int64)
    starts[1:] = np.cumsum(lengths)[:-1]
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), starts, lengths


def render(ids: np.ndarray, lengths: np.ndarray, vocab: tuple[np.ndarray, np.ndarray, np.ndarray]) -> bytes:
    """Lines of space-separated words: sentence ``i`` is the next ``lengths[i]`` entries of ``ids``."""
    blob, starts, sizes = vocab
    spans = sizes[ids] + 1  # each word and the space (or newline) after it
    ends = np.cumsum(spans)
    out = np.full(int(ends[-1]), ord(" "), dtype=np.uint8)
    # Byte k of word j sits at ends[j] - spans[j] + k; gather every word's bytes in one pass.
    within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - spans, spans)
    source = np.repeat(starts[ids], spans) + within
    letters = within < np.repeat(sizes[ids], spans)
    out[letters] = blob[source[letters]]
    out[ends[np.cumsum(lengths) - 1] - 1] = ord("\n")
    return out.tobytes()


def sentence_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """English and German words per sentence for ``n`` pairs."""
    mu = np.log(MEAN_WORDS) - SIGMA**2 / 2  # mean of the lognormal = MEAN_WORDS
    english = np.clip(np.rint(rng.lognormal(mu, SIGMA, n)), 1, MAX_WORDS).astype(np.int64)
    ratio = rng.lognormal(np.log(0.95), 0.15, n)
    german = np.clip(np.rint(english * ratio), 1, MAX_WORDS).astype(np.int64)
    return english, german


def write_split(
    out: Path, split: str, pairs: int, rng: np.random.Generator, tables: dict[str, object], plain: bool
) -> None:
    """``pairs`` pairs of ``split`` into ``out/{split}.{en,de}[.gz]``, in chunks."""
    cdf: np.ndarray = tables["cdf"]  # type: ignore[assignment]
    mapping: np.ndarray = tables["mapping"]  # type: ignore[assignment]
    suffix = "" if plain else ".gz"

    def opener(lang: str) -> BinaryIO:
        path = out / f"{split}.{lang}{suffix}"
        if plain:
            return open(path, "wb")
        return gzip.open(path, "wb", compresslevel=1)  # type: ignore[return-value]

    with opener("en") as en_file, opener("de") as de_file:
        for start in range(0, pairs, CHUNK):
            n = min(CHUNK, pairs - start)
            en_len, de_len = sentence_lengths(n, rng)
            en_ids = np.searchsorted(cdf, rng.random(int(en_len.sum())), side="right")
            en_ids = np.minimum(en_ids, len(cdf) - 1)
            # German: the permuted English words, cut or padded with fresh draws to the German length.
            en_starts = np.cumsum(en_len) - en_len
            de_starts = np.cumsum(de_len) - de_len
            position = np.arange(int(de_len.sum())) - np.repeat(de_starts, de_len)
            sentence = np.repeat(np.arange(n), de_len)
            aligned = position < en_len[sentence]
            fresh = np.minimum(np.searchsorted(cdf, rng.random(len(position)), side="right"), len(cdf) - 1)
            source = np.where(aligned, en_starts[sentence] + np.minimum(position, en_len[sentence] - 1), 0)
            de_ids = np.where(aligned, mapping[en_ids[source]], fresh)
            en_file.write(render(en_ids, en_len, tables["en"]))  # type: ignore[arg-type]
            de_file.write(render(de_ids, de_len, tables["de"]))  # type: ignore[arg-type]
            if start // CHUNK % 10 == 9:
                logger.info("%s: %d of %d pairs", split, start + n, pairs)


def write(out: str | Path, pairs: int, seed: int = 0, *, held_out: int = 3000, plain: bool = False) -> Path:
    """Write the corpus (``pairs`` training pairs, ``held_out`` in val and in test) into ``out``."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ranks = np.arange(VOCABULARY, dtype=np.float64)
    weights = (ranks + ZIPF_OFFSET) ** -ZIPF_EXPONENT
    similar_rank = np.argsort(np.arange(VOCABULARY - 2) + rng.normal(0, 50, VOCABULARY - 2))
    tables: dict[str, object] = {
        "en": packed(lexicon("en", VOCABULARY, rng)),
        "de": packed(lexicon("de", VOCABULARY, rng)),
        "cdf": np.cumsum(weights) / weights.sum(),
        # punctuation stays punctuation; other words map to German words of a similar rank
        "mapping": np.concatenate([[0, 1], 2 + similar_rank]),
    }
    for split, n in (("train", pairs), ("val", held_out), ("test", held_out)):
        write_split(root, split, n, rng, tables, plain)
    return root


def main(argv: list[str] | None = None) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--out", required=True, help="directory to write {train,val,test}.{en,de}.gz into")
    parser.add_argument("--pairs", type=int, default=4_500_000, help="training pairs (WMT14 En-De: 4.5M)")
    parser.add_argument("--held-out", type=int, default=3000, help="pairs in val and in test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="uncompressed files instead of .gz")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.perf_counter()
    write(args.out, args.pairs, args.seed, held_out=args.held_out, plain=args.plain)
    logger.info("wrote %s in %.0f s", args.out, time.perf_counter() - started)


if __name__ == "__main__":
    main()
