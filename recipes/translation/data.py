"""Parallel text, a joint subword tokenizer, and token-budget batches for the translation recipe.

Three steps, each a plain function or class:

1. :func:`read_split`, the one reader of training and ``eval.bleu``, takes three kinds of source
   (``recipes.common.sources``): :func:`read_local` reads a directory of ``{split}.{lang}`` or
   ``{split}.{lang}.gz`` files (one sentence per line, lines aligned across languages: the layout
   of Multi30k); :func:`read_translations` reads the ``translation`` column of a local ``datasets``
   directory (``save_to_disk`` or the hub's parquet files) or of a hub corpus (``wmt/wmt14``),
   through ``datasets`` (imported only then). Bad input raises :class:`DataError` naming the file
   (and line) or the dataset (and split, column or language) and what is expected.
2. :func:`build_tokenizer` trains a joint BPE tokenizer (HF ``tokenizers``) on the source and target
   training text, cached under a hash of that text and of the settings, or loads one from a path.
   It is a ``PreTrainedTokenizerFast``: ``save_pretrained(dir)`` next to a model makes
   ``AutoTokenizer.from_pretrained(dir)`` work.
3. :class:`TokenBatches` groups examples of similar length into batches of at most ``max_tokens``
   padded tokens, in an order that depends only on (seed, epoch), and gives each rank a disjoint,
   equally long share of them, so a run resumed at (epoch, batch) continues exactly.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recipes.common import sources as data_sources

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>", "<s>"]  # ids 0, 1, 2, 3
TOKENIZER_FORMAT = 1  # part of the cache key: bump when the tokenizer recipe below changes
HUB_PAIRS = {"wmt/wmt14": ("cs-en", "de-en", "fr-en", "hi-en", "ru-en")}


DataError = data_sources.DataError
"""Input data that cannot be trained on; the message names the file (and line) and what is expected."""


# 1. Reading parallel text -----------------------------------------------------------------------


def split_file(directory: str | os.PathLike[str], split: str, lang: str) -> Path:
    """The file of ``split`` in ``lang``: ``{split}.{lang}`` or ``{split}.{lang}.gz`` in ``directory``."""
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist (expected a directory of {split}.{lang}[.gz])")
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        if (root / name).is_file():
            return root / name
    languages = sorted({p.name.split(".")[1] for p in root.iterdir() if p.name.startswith(f"{split}.")})
    found = f"; {split} exists in {', '.join(languages)}" if languages else f"; there is no {split}.* file"
    raise DataError(
        f"missing data file {root / f'{split}.{lang}'} (or {split}.{lang}.gz): expected one sentence per "
        f"line{found}"
    )


def read_lines(path: Path) -> list[str]:
    """Lines of a text file (``.gz`` decompressed), stripped; an empty file or line raises DataError."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            lines = [line.strip() for line in handle]
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(
            f"cannot read {path}: {error} (expected UTF-8 text, gzipped if it ends in .gz)"
        ) from None
    if not lines:
        raise DataError(f"{path} is empty: expected one sentence per line")
    for number, line in enumerate(lines, start=1):
        if not line:
            raise DataError(
                f"{path}, line {number}, is empty: expected one sentence on every line, aligned with the "
                "other language's file"
            )
    return lines


def read_local(
    directory: str | os.PathLike[str], split: str, src: str, tgt: str, limit: int = 0
) -> tuple[list[str], list[str]]:
    """Aligned (source, target) sentences of ``split``; at most ``limit`` pairs when ``limit > 0``."""
    if src == tgt:
        raise DataError(f"unknown language pair {src}-{tgt}: source and target must differ")
    src_path, tgt_path = split_file(directory, split, src), split_file(directory, split, tgt)
    sources, targets = read_lines(src_path), read_lines(tgt_path)
    if len(sources) != len(targets):
        raise DataError(
            f"{src_path} has {len(sources)} lines but {tgt_path} has {len(targets)}: parallel files must "
            f"have one line per sentence pair (they first differ in length after line "
            f"{min(len(sources), len(targets))})"
        )
    return (sources[:limit], targets[:limit]) if limit > 0 else (sources, targets)


def hub_config(name: str, src: str, tgt: str) -> str | None:
    """The ``datasets`` config of a hub corpus for a language pair (WMT14: ``de-en``, ``fr-en``, ...);
    None for a hub name not in :data:`HUB_PAIRS` (its only config, or ``datasets`` says which exist)."""
    if name not in HUB_PAIRS:
        return None
    return pair_config(name, HUB_PAIRS[name], src, tgt)


def pair_config(name: str, configs: Iterable[str], src: str, tgt: str) -> str:
    """The config of ``configs`` named after the pair (``de-en`` for en-de and de-en)."""
    configs = sorted(configs)
    for config in configs:
        if set(config.split("-")) == {src, tgt}:
            return config
    raise DataError(
        f"unknown language pair {src}-{tgt} for {name}: expected one of {', '.join(configs)} "
        "(in either direction)"
    )


def read_translations(
    dataset: Any, name: str, split: str, src: str, tgt: str, limit: int = 0
) -> tuple[list[str], list[str]]:
    """(source, target) sentences of a ``datasets`` split with a ``translation`` column of
    ``{lang: sentence}`` dicts (WMT14's layout). Pairs with an empty side are dropped."""
    data_sources.require_columns(dataset, name, split, {"translation": "a {language: sentence} dict per row"})
    feature = dataset.features["translation"]
    languages = list(getattr(feature, "languages", None) or (feature if isinstance(feature, dict) else []))
    missing = [lang for lang in (src, tgt) if lang not in languages]
    if missing:
        raise DataError(
            f"{name} (split {split}): its translation column has no {', '.join(missing)}; it has "
            f"{', '.join(sorted(languages)) or 'no languages'} (expected the pair {src}-{tgt})"
        )
    columns = dataset.select_columns(["translation"]).flatten()
    pairs = zip(columns[f"translation.{src}"], columns[f"translation.{tgt}"], strict=True)
    stripped = ((s.strip() if s else "", t.strip() if t else "") for s, t in pairs)
    kept = [(s, t) for s, t in stripped if s and t]
    if not kept:
        raise DataError(f"{name} (split {split}): no pair with both sides non-empty")
    if limit > 0:
        kept = kept[:limit]
    return [s for s, _ in kept], [t for _, t in kept]


def read_split(source: str, split: str, src: str, tgt: str, limit: int = 0) -> tuple[list[str], list[str]]:
    """(source, target) sentences of ``split``: the one reader of training and ``eval.bleu``.

    ``source`` is a directory of ``{split}.{lang}[.gz]`` files (:func:`read_local`), a local
    ``datasets`` directory (``save_to_disk``, or parquet files in the hub's layout such as
    ``DIR/de-en/train-00000-of-00003.parquet``) or a hub name (``wmt/wmt14``); the last two need
    a ``translation`` column (:func:`read_translations`). At most ``limit`` pairs when ``limit > 0``.
    """
    if src == tgt:
        raise DataError(f"unknown language pair {src}-{tgt}: source and target must differ")
    kind = data_sources.source_kind(source, files=f"{split}.{src} and {split}.{tgt} files", hub="wmt/wmt14")
    if kind == "files":
        return read_local(source, split, src, tgt, limit)
    config = None
    if kind == "hub":
        config = hub_config(source, src, tgt)
    elif kind == "parquet":
        configs = [c for c in data_sources.parquet_layout(source) if c]
        config = pair_config(source, configs, src, tgt) if len(configs) > 1 else None
    dataset = data_sources.load_split(source, kind, split, config)
    return read_translations(dataset, source, split, src, tgt, limit)


# 2. The joint subword tokenizer -----------------------------------------------------------------


def text_fingerprint(texts: Iterable[Iterable[str]], *settings: object) -> str:
    """sha256 of the texts (in order) and the settings: the tokenizer cache key."""
    digest = hashlib.sha256(repr((TOKENIZER_FORMAT, *settings)).encode())
    for text in texts:
        for line in text:
            digest.update(line.encode())
            digest.update(b"\n")
        digest.update(b"\x00")
    return digest.hexdigest()


def train_tokenizer(texts: Iterable[Iterable[str]], vocab_size: int, max_length: int = 1024) -> Any:
    """A BPE tokenizer on NFKC text with sentencepiece-style word boundaries (so decoding is lossless
    for normalised text), ids 0-3 = ``<pad> </s> <unk> <s>``, and ``</s>`` appended to every input."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tokenizer.train_from_iterator((line for text in texts for line in text), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        bos_token="<s>",
        model_max_length=max_length,
    )


def tokenizer_cache(cache_dir: str = "") -> Path:
    """Where trained tokenizers are cached: ``cache_dir``, or ``~/.cache/decentadam/translation``."""
    return Path(cache_dir) if cache_dir else Path.home() / ".cache" / "decentadam" / "translation"


def build_tokenizer(
    texts: list[list[str]], vocab_size: int, cache_dir: str | os.PathLike[str], path: str = ""
) -> tuple[Any, Path]:
    """Load the tokenizer at ``path``, or train one on ``texts`` and cache it; return it and its directory.

    The cache entry is ``cache_dir/tokenizer-<hash>``, the hash covering every line of ``texts`` and
    the settings, so changed data or vocabulary size trains a new one. Written atomically (a
    temporary directory renamed into place), so concurrent runs never read half a tokenizer.
    """
    from transformers import AutoTokenizer

    if path:
        if not Path(path).is_dir():
            raise DataError(
                f"tokenizer path {path} is not a directory (expected one written by save_pretrained)"
            )
        return AutoTokenizer.from_pretrained(path), Path(path)
    key = text_fingerprint(texts, vocab_size)[:20]
    directory = Path(cache_dir) / f"tokenizer-{key}"
    if (directory / "tokenizer.json").is_file():
        logger.info("tokenizer from the cache: %s", directory)
        return AutoTokenizer.from_pretrained(directory), directory
    logger.info("training a %d-token BPE tokenizer on %d texts", vocab_size, len(texts))
    tokenizer = train_tokenizer(texts, vocab_size)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=cache_dir))
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(directory)
    except OSError:  # another process cached the same tokenizer first
        shutil.rmtree(staging, ignore_errors=True)
    return AutoTokenizer.from_pretrained(directory), directory


@dataclass
class Encoded:
    """Token ids of aligned sentence pairs, stored flat: pair ``i`` is
    ``src_ids[src_offsets[i]:src_offsets[i + 1]]`` (each ending in ``</s>``), the same for target."""

    src_ids: np.ndarray
    src_offsets: np.ndarray
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_lengths(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    @property
    def tgt_lengths(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)

    def pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        s, t = self.src_offsets, self.tgt_offsets
        return self.src_ids[s[index] : s[index + 1]], self.tgt_ids[t[index] : t[index + 1]]


def encode(tokenizer: Any, sources: list[str], targets: list[str], max_length: int = 0) -> Encoded:
    """Tokenize the pairs; with ``max_length > 0`` drop pairs with a side longer than that (tokens)."""

    def flat(texts: list[str]) -> list[list[int]]:
        return list(tokenizer(texts, add_special_tokens=True)["input_ids"])

    src, tgt = flat(sources), flat(targets)
    if max_length > 0:
        keep = [i for i in range(len(src)) if len(src[i]) <= max_length and len(tgt[i]) <= max_length]
        if len(keep) < len(src):
            logger.info(
                "dropped %d of %d pairs longer than %d tokens", len(src) - len(keep), len(src), max_length
            )
        src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]

    def pack(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(r) for r in rows])
        ids = np.fromiter((i for r in rows for i in r), dtype=np.int32, count=int(offsets[-1]))
        return ids, offsets

    (src_ids, src_offsets), (tgt_ids, tgt_offsets) = pack(src), pack(tgt)
    return Encoded(src_ids, src_offsets, tgt_ids, tgt_offsets)


# 3. Token-budget batches ------------------------------------------------------------------------


class TokenBatches:
    """This rank's batches (lists of example indices) for one epoch, by a budget of padded tokens.

    A batch costs ``len(batch) * max(longest source, longest target)`` tokens and never more than
    ``max_tokens`` (a single longer example is a batch of its own). For epoch ``e``:

    1. examples are sorted by length, ties broken by a permutation drawn from ``(seed, e)``;
    2. consecutive examples fill batches up to the budget;
    3. while the number of batches is not a multiple of ``world_size * multiple_of``, the largest
       batch is split in two (so every rank gets as many batches, a multiple of ``multiple_of``,
       the micro-batches of one optimizer step, and no example is dropped or repeated);
    4. the batches are shuffled with the same generator and rank ``r`` takes every
       ``world_size``-th one starting at ``r``.

    Every example appears in exactly one batch of one rank per epoch; ``epoch_batches(e)[b:]`` is
    where a run stopped after ``b`` batches of epoch ``e`` continues. With ``shuffle=False`` the
    order is by length (for evaluation).
    """

    def __init__(
        self,
        src_lengths: np.ndarray,
        tgt_lengths: np.ndarray,
        max_tokens: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        multiple_of: int = 1,
        shuffle: bool = True,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.lengths = np.maximum(np.asarray(src_lengths), np.asarray(tgt_lengths)).astype(np.int64)
        if len(self.lengths) < world_size * multiple_of:
            raise ValueError(
                f"{len(self.lengths)} examples cannot give each of {world_size} ranks {multiple_of} batches"
            )
        self.max_tokens, self.seed, self.rank, self.world_size = max_tokens, seed, rank, world_size
        self.multiple_of, self.shuffle = multiple_of, shuffle

    def all_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of ``epoch``, in order (rank ``r`` takes positions r, r + W, ...)."""
        generator = np.random.default_rng([self.seed, epoch])
        if self.shuffle:
            tie_break = generator.permutation(len(self.lengths))
            order = tie_break[np.argsort(self.lengths[tie_break], kind="stable")]
        else:
            order = np.argsort(self.lengths, kind="stable")
        batches: list[np.ndarray] = []
        start, longest = 0, 0
        for position, index in enumerate(order):
            longest_if_added = max(longest, int(self.lengths[index]))
            if position > start and longest_if_added * (position - start + 1) > self.max_tokens:
                batches.append(order[start:position])
                start, longest_if_added = position, int(self.lengths[index])
            longest = longest_if_added
        batches.append(order[start:])
        quantum = self.world_size * self.multiple_of
        while len(batches) % quantum:
            splittable = [b for b in range(len(batches)) if len(batches[b]) > 1]
            if not splittable:
                raise ValueError(
                    f"{len(batches)} single-example batches cannot be shared evenly by {self.world_size} "
                    "ranks "
                    f"x {self.multiple_of} micro-batches; raise max_tokens"
                )
            largest = max(splittable, key=lambda b: len(batches[b]))
            half = len(batches[largest]) // 2
            batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
        if self.shuffle:
            batches = [batches[i] for i in generator.permutation(len(batches))]
        return batches

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch``."""
        return self.all_batches(epoch)[self.rank :: self.world_size]


def collate(data: Encoded, indices: np.ndarray, pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (B, S), ``labels`` (B, T; padding = -100) and
    ``decoder_input_ids`` (B, T: the labels shifted right behind ``<pad>``, Marian's decoder start)."""
    pairs = [data.pair(int(i)) for i in indices]
    src_len = max(len(s) for s, _ in pairs)
    tgt_len = max(len(t) for _, t in pairs)
    input_ids = torch.full((len(pairs), src_len), pad_id, dtype=torch.long)  # (B, S)
    labels = torch.full((len(pairs), tgt_len), -100, dtype=torch.long)  # (B, T)
    for row, (s, t) in enumerate(pairs):
        input_ids[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
        labels[row, : len(t)] = torch.from_numpy(t.astype(np.int64))
    decoder_input_ids = torch.full_like(labels, pad_id)  # (B, T)
    shifted = labels[:, :-1]
    decoder_input_ids[:, 1:] = torch.where(shifted == -100, pad_id, shifted)
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != pad_id).long(),
        "labels": labels,
        "decoder_input_ids": decoder_input_ids,
    }


def iterate(
    data: Encoded, batches: list[np.ndarray], pad_id: int, start: int = 0
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(batch index, collated batch) from position ``start`` of ``batches``."""
    for position in range(start, len(batches)):
        yield position, collate(data, batches[position], pad_id)
