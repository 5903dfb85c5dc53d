"""Parallel text, a joint subword tokenizer, token ids cached on disk, and token-budget batches for
the translation recipe.

Four steps, each a plain function or class:

1. :func:`read_split`, the one reader of training and ``eval.bleu``, takes three kinds of source
   (``recipes.common.sources``): :func:`read_local` reads a directory of ``{split}.{lang}`` or
   ``{split}.{lang}.gz`` files (one sentence per line, lines aligned across languages: the layout
   of Multi30k); :func:`read_translations` reads the ``translation`` column of a local ``datasets``
   directory (``save_to_disk`` or the hub's parquet files) or of a hub corpus (``wmt/wmt14``),
   through ``datasets`` (imported only then). :func:`stream_split` reads the same in chunks. Bad
   input raises :class:`DataError` naming the file (and line) or the dataset (and split, column or
   language) and what is expected.
2. :func:`prepare_tokenizer` trains a joint BPE tokenizer (HF ``tokenizers``) on a bounded, seeded
   sample of the training pairs (:func:`sample_pairs`), cached under a key of the data's identity
   (files, sizes, times: no line is read to find it) and the settings, or loads one from a path.
   It is a ``PreTrainedTokenizerFast``: ``save_pretrained(dir)`` next to a model makes
   ``AutoTokenizer.from_pretrained(dir)`` work. (:func:`build_tokenizer` trains on given texts.)
3. :func:`cached_encode` tokenizes a split once, in chunks, into a cache directory of flat token
   id arrays that every rank memory-maps (:class:`Encoded`); a partial or corrupt entry is rebuilt,
   never used. :func:`prepare_data` does steps 2 and 3 for a config's ``data`` section.
4. :class:`TokenBatches` groups examples of similar length into batches of at most ``max_tokens``
   padded tokens, in an order that depends only on (seed, epoch), and gives each rank a disjoint,
   equally long share of them, so a run resumed at (epoch, batch) continues exactly.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from recipes.common import sources as data_sources

if TYPE_CHECKING:
    from recipes.translation.config import DataConfig

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
    if not languages:
        splits = sorted({p.name.split(".")[0] for p in root.iterdir() if p.is_file() and "." in p.name})
        found += f" (the splits here: {', '.join(splits)})" if splits else " (nor any other split)"
    raise DataError(
        f"missing data file {root / f'{split}.{lang}'} (or {split}.{lang}.gz): expected one sentence per "
        f"line{found}"
    )


def local_splits(source: str | os.PathLike[str]) -> list[str] | None:
    """The splits of a directory of ``{split}.{lang}[.gz]`` files (those with a file in any
    language), sorted; None when ``source`` is not such a directory (a ``datasets`` one, a hub name)."""
    root = Path(source)
    if not root.is_dir() or data_sources.source_kind(str(root), files="", hub="") != "files":
        return None
    names = {p.name.removesuffix(".gz") for p in root.iterdir() if p.is_file()}
    return sorted({name.rsplit(".", 1)[0] for name in names if "." in name})


def stream_lines(path: Path, chunk: int = 100_000) -> Iterator[list[str]]:
    """Lines of a text file (``.gz`` decompressed), stripped, ``chunk`` at a time; an empty line raises
    DataError naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    number = 0
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            while lines := [line.strip() for line in itertools.islice(handle, chunk)]:
                if not all(lines):
                    empty = number + lines.index("") + 1
                    raise DataError(
                        f"{path}, line {empty}, is empty: expected one sentence on every line, aligned "
                        "with the other language's file"
                    )
                number += len(lines)
                yield lines
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(
            f"cannot read {path}: {error} (expected UTF-8 text, gzipped if it ends in .gz)"
        ) from None


def stream_local(
    directory: str | os.PathLike[str], split: str, src: str, tgt: str, limit: int = 0, chunk: int = 100_000
) -> Iterator[tuple[list[str], list[str]]]:
    """Aligned (source, target) sentences of ``split``, ``chunk`` pairs at a time (:func:`read_local`)."""
    if src == tgt:
        raise DataError(f"unknown language pair {src}-{tgt}: source and target must differ")
    src_path, tgt_path = split_file(directory, split, src), split_file(directory, split, tgt)
    sources, targets = stream_lines(src_path, chunk), stream_lines(tgt_path, chunk)
    counts = [0, 0]
    none: list[str] = []
    for source_lines, target_lines in itertools.zip_longest(sources, targets, fillvalue=none):
        counts[0] += len(source_lines)
        counts[1] += len(target_lines)
        if counts[0] != counts[1]:
            for path, count in ((src_path, counts[0]), (tgt_path, counts[1])):
                if count == 0:
                    raise DataError(f"{path} is empty: expected one sentence per line")
            counts[0] += sum(len(rest) for rest in sources)
            counts[1] += sum(len(rest) for rest in targets)
            raise DataError(
                f"{src_path} has {counts[0]} lines but {tgt_path} has {counts[1]}: parallel files must "
                f"have one line per sentence pair (they first differ in length after line "
                f"{min(counts)})"
            )
        if limit > 0 and counts[0] >= limit:
            keep = len(source_lines) - (counts[0] - limit)
            yield source_lines[:keep], target_lines[:keep]
            return
        yield source_lines, target_lines
    for path, count in ((src_path, counts[0]), (tgt_path, counts[1])):
        if count == 0:
            raise DataError(f"{path} is empty: expected one sentence per line")


def read_local(
    directory: str | os.PathLike[str], split: str, src: str, tgt: str, limit: int = 0
) -> tuple[list[str], list[str]]:
    """Aligned (source, target) sentences of ``split``; at most ``limit`` pairs when ``limit > 0``."""
    return concatenated(stream_local(directory, split, src, tgt, limit))


def concatenated(chunks: Iterable[tuple[list[str], list[str]]]) -> tuple[list[str], list[str]]:
    sources: list[str] = []
    targets: list[str] = []
    for source_lines, target_lines in chunks:
        sources += source_lines
        targets += target_lines
    return sources, targets


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


def stream_translations(
    dataset: Any, name: str, split: str, src: str, tgt: str, limit: int = 0, chunk: int = 100_000
) -> Iterator[tuple[list[str], list[str]]]:
    """(source, target) sentences of a ``datasets`` split with a ``translation`` column of
    ``{lang: sentence}`` dicts (WMT14's layout), ``chunk`` rows at a time, read as Arrow batches so
    only a chunk is ever in Python objects. Pairs with an empty side are dropped."""
    data_sources.require_columns(dataset, name, split, {"translation": "a {language: sentence} dict per row"})
    feature = dataset.features["translation"]
    languages = list(getattr(feature, "languages", None) or (feature if isinstance(feature, dict) else []))
    missing = [lang for lang in (src, tgt) if lang not in languages]
    if missing:
        raise DataError(
            f"{name} (split {split}): its translation column has no {', '.join(missing)}; it has "
            f"{', '.join(sorted(languages)) or 'no languages'} (expected the pair {src}-{tgt})"
        )
    kept = 0
    batches = dataset.select_columns(["translation"]).with_format("arrow").iter(batch_size=chunk)
    for table in batches:
        columns = table.flatten()  # translation.{lang}: null where the row's dict is null
        pairs = zip(
            columns.column(f"translation.{src}").to_pylist(),
            columns.column(f"translation.{tgt}").to_pylist(),
            strict=True,
        )
        stripped = ((s.strip() if s else "", t.strip() if t else "") for s, t in pairs)
        rows = [(s, t) for s, t in stripped if s and t]
        if limit > 0:
            rows = rows[: limit - kept]
        kept += len(rows)
        if rows:
            yield [s for s, _ in rows], [t for _, t in rows]
        if limit > 0 and kept >= limit:
            return
    if not kept:
        raise DataError(f"{name} (split {split}): no pair with both sides non-empty")


def read_translations(
    dataset: Any, name: str, split: str, src: str, tgt: str, limit: int = 0
) -> tuple[list[str], list[str]]:
    """(source, target) sentences of a ``datasets`` split (:func:`stream_translations`)."""
    return concatenated(stream_translations(dataset, name, split, src, tgt, limit))


def stream_split(
    source: str, split: str, src: str, tgt: str, limit: int = 0, chunk: int = 100_000
) -> Iterator[tuple[list[str], list[str]]]:
    """(source, target) sentences of ``split``, ``chunk`` pairs at a time: :func:`read_split`'s
    reading, in bounded memory (what the token cache is built from)."""
    if src == tgt:
        raise DataError(f"unknown language pair {src}-{tgt}: source and target must differ")
    kind = data_sources.source_kind(source, files=f"{split}.{src} and {split}.{tgt} files", hub="wmt/wmt14")
    if kind == "files":
        yield from stream_local(source, split, src, tgt, limit, chunk)
        return
    dataset = data_sources.load_split(source, kind, split, dataset_config(source, kind, src, tgt))
    yield from stream_translations(dataset, source, split, src, tgt, limit, chunk)


def dataset_config(source: str, kind: data_sources.Kind, src: str, tgt: str) -> str | None:
    """The config (language pair) of a hub or parquet source; None for one with a single config."""
    if kind == "hub":
        return hub_config(source, src, tgt)
    if kind == "parquet":
        configs = [c for c in data_sources.parquet_layout(source) if c]
        return pair_config(source, configs, src, tgt) if len(configs) > 1 else None
    return None


def read_split(source: str, split: str, src: str, tgt: str, limit: int = 0) -> tuple[list[str], list[str]]:
    """(source, target) sentences of ``split``: the one reader of training and ``eval.bleu``.

    ``source`` is a directory of ``{split}.{lang}[.gz]`` files (:func:`read_local`), a local
    ``datasets`` directory (``save_to_disk``, or parquet files in the hub's layout such as
    ``DIR/de-en/train-00000-of-00003.parquet``) or a hub name (``wmt/wmt14``); the last two need
    a ``translation`` column (:func:`read_translations`). At most ``limit`` pairs when ``limit > 0``.
    Training reads through :func:`stream_split` into the token cache instead (:func:`cached_encode`).
    """
    return concatenated(stream_split(source, split, src, tgt, limit))


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


def train_tokenizer(
    texts: Iterable[Iterable[str]], vocab_size: int, max_length: int = 1024, *, show_progress: bool = False
) -> Any:
    """A BPE tokenizer on NFKC text with sentencepiece-style word boundaries (so decoding is lossless
    for normalised text), ids 0-3 = ``<pad> </s> <unk> <s>``, and ``</s>`` appended to every input."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=show_progress
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
    return cache_tokenizer(train_tokenizer(texts, vocab_size), directory)


def cache_tokenizer(tokenizer: Any, directory: Path) -> tuple[Any, Path]:
    """Save ``tokenizer`` as ``directory`` atomically (a temporary directory renamed into place, so
    concurrent runs never read half a tokenizer); load it back from there."""
    from transformers import AutoTokenizer

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=directory.parent))
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(directory)
    except OSError:  # another process cached the same tokenizer first
        shutil.rmtree(staging, ignore_errors=True)
    return AutoTokenizer.from_pretrained(directory), directory


def prepare_tokenizer(
    source: str, split: str, src: str, tgt: str, *, vocab_size: int, sample: int,
    cache_dir: str | os.PathLike[str], path: str = "", limit: int = 0, progress: bool = False,
) -> tuple[Any, Path]:  # fmt: skip
    """The tokenizer of a training split: the one at ``path``, or one trained on a sample of the split.

    The sample is ``sample`` pairs (all when 0 or when the split has fewer) drawn uniformly, the same
    every time (:func:`sample_pairs`); the cache entry ``cache_dir/tokenizer-<hash>`` is keyed by the
    split's identity (:func:`source_identity`: files, sizes and times, not their lines, so a rank can
    find it without reading the data) and the settings. Only this function reads text (one pass).
    """
    if path:
        return build_tokenizer([], vocab_size, cache_dir, path=path)
    identity = source_identity(source, split, src, tgt)
    key = fingerprint(TOKENIZER_FORMAT, identity, split, src, tgt, limit, sample, vocab_size)
    directory = Path(cache_dir) / f"tokenizer-{key}"
    if (directory / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        logger.info("tokenizer from the cache: %s", directory)
        return AutoTokenizer.from_pretrained(directory), directory
    from tqdm.auto import tqdm

    with tqdm(desc=f"reading {split} for the tokenizer", unit=" pairs", disable=not progress) as bar:
        chunks = counted(stream_split(source, split, src, tgt, limit), bar)
        sources, targets, total = sample_pairs(chunks, sample)
    if progress:
        logger.info("training a %d-token BPE tokenizer on %d of %d pairs", vocab_size, len(sources), total)
    tokenizer = train_tokenizer([sources, targets], vocab_size, show_progress=progress)
    return cache_tokenizer(tokenizer, directory)


def counted(chunks: Iterable[tuple[list[str], list[str]]], bar: Any) -> Iterator[tuple[list[str], list[str]]]:
    """``chunks``, counting their pairs on the progress bar ``bar``."""
    for chunk in chunks:
        bar.update(len(chunk[0]))
        yield chunk


def sample_pairs(
    chunks: Iterable[tuple[list[str], list[str]]], size: int, seed: int = 0
) -> tuple[list[str], list[str], int]:
    """A uniform sample of ``size`` pairs from ``chunks`` (every pair when 0 or when there are fewer),
    in their order in the data, and the number of pairs read.

    Bottom-k sampling: each pair draws a key from a generator seeded with ``seed`` and the ``size``
    smallest keys are kept, so one pass with ``size`` pairs in memory gives the same sample every time.
    """
    generator = np.random.default_rng(seed)
    sources: list[str] = []
    targets: list[str] = []
    keys, positions = np.empty(0), np.empty(0, dtype=np.int64)
    total = 0
    for source_lines, target_lines in chunks:
        count, first = len(source_lines), total
        total += count
        chunk_keys = generator.random(count)
        fill = count if size <= 0 else min(size - len(sources), count)
        if fill > 0:
            sources += source_lines[:fill]
            targets += target_lines[:fill]
            keys = np.concatenate([keys, chunk_keys[:fill]])
            positions = np.concatenate([positions, np.arange(first, first + fill)])
        if fill == count:
            continue
        rest = np.arange(max(fill, 0), count)
        better = rest[chunk_keys[rest] < keys.max()]
        if not len(better):
            continue
        # The size smallest of the kept and the better keys: newcomers replace the evicted slots.
        kept = np.argpartition(np.concatenate([keys, chunk_keys[better]]), size - 1)[:size]
        incoming = better[kept[kept >= size] - size]
        evicted = np.setdiff1d(np.arange(size), kept[kept < size], assume_unique=True)
        for slot, row in zip(evicted.tolist(), incoming.tolist(), strict=True):
            sources[slot], targets[slot] = source_lines[row], target_lines[row]
        keys[evicted], positions[evicted] = chunk_keys[incoming], first + incoming
    order = np.argsort(positions, kind="stable").tolist()
    if order != list(range(len(order))):
        sources, targets = [sources[i] for i in order], [targets[i] for i in order]
    return sources, targets, total


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

    backend = getattr(tokenizer, "backend_tokenizer", None)

    def flat(texts: list[str]) -> list[list[int]]:
        if backend is None:
            return list(tokenizer(texts, add_special_tokens=True)["input_ids"])
        # The same ids as tokenizer(texts)["input_ids"] (no truncation is set), without building
        # offsets, attention masks and a BatchEncoding: a third less time at WMT scale.
        batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: tokenizers >= 0.21
        return [encoding.ids for encoding in batch(texts, add_special_tokens=True)]

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


# 2b. The token cache: a split's token ids, encoded once, memory-mapped by every rank -------------

CACHE_FORMAT = 1  # part of the token cache key: bump when the layout below or the encoding changes
SIDES = ("src", "tgt")


class CacheError(Exception):
    """A token cache directory that cannot be trusted (missing, truncated or inconsistent files)."""


def fingerprint(*parts: object) -> str:
    """A cache key: the start of the sha256 of the parts as JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def source_identity(source: str, split: str, src: str, tgt: str) -> dict[str, Any]:
    """What identifies a split's data without reading it: for local data each file's path, size and
    modification time (the split's two files, or every file of a ``datasets`` directory); for a hub
    name the name, config and split (a new revision of a hub corpus needs a new ``cache_dir``)."""
    kind = data_sources.source_kind(source, files=f"{split}.{src} and {split}.{tgt} files", hub="wmt/wmt14")
    if kind == "hub":
        return {"hub": source, "config": dataset_config(source, kind, src, tgt), "split": split}
    if kind == "files":
        paths = [split_file(source, split, src), split_file(source, split, tgt)]
    else:
        paths = sorted(p for p in Path(source).rglob("*") if p.is_file())
    stats = [(str(p.resolve()), p.stat()) for p in paths]
    return {"kind": kind, "files": [[name, st.st_size, st.st_mtime_ns] for name, st in stats]}


def cached_encode(
    tokenizer: Any, tokenizer_dir: Path, source: str, split: str, src: str, tgt: str, *,
    cache_dir: str | os.PathLike[str], limit: int = 0, max_length: int = 0, chunk: int = 100_000,
    progress: bool = False,
) -> Encoded:  # fmt: skip
    """:func:`encode` of a split, through a cache on disk: the arrays are memory-mapped, not in memory.

    The entry ``cache_dir/tokens-<key>/`` is keyed by the split's identity (:func:`source_identity`),
    ``split``, the languages, ``limit``, ``max_length``, the tokenizer (a hash of its
    ``tokenizer.json``) and :data:`CACHE_FORMAT`. It holds ``{src,tgt}_ids.bin`` (int32, raw),
    ``{src,tgt}_offsets.npy`` (int64) and ``meta.json`` (counts, the key's inputs, the sha256 of
    each offsets array). It is built in a temporary directory of ``cache_dir`` from
    :func:`stream_split` in chunks of ``chunk`` pairs (memory stays bounded), then renamed into
    place: the rename is the last act, so a complete directory is the only kind that exists. Opening
    checks meta, file sizes, the offsets' hashes and their consistency with the ids (not the ids'
    content); an entry that fails is logged, removed and rebuilt, never used.

    With several processes, call it in the main process first and in the others after (the recipe
    does): they then open the entry without reading the data.
    """
    digest = hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()
    inputs = {
        "format": CACHE_FORMAT, "data": source_identity(source, split, src, tgt), "split": split,
        "src": src, "tgt": tgt, "limit": limit, "max_length": max_length, "tokenizer": digest,
    }  # fmt: skip
    key = fingerprint(inputs)
    directory = Path(cache_dir) / f"tokens-{key}"
    if directory.exists():
        try:
            return open_tokens(directory, key)
        except CacheError as error:
            logger.warning("token cache %s cannot be trusted (%s): rebuilding it", directory, error)
            shutil.rmtree(directory, ignore_errors=True)
    build_tokens(tokenizer, directory, key, inputs, source, split, src, tgt, chunk=chunk, progress=progress)
    return open_tokens(directory, key)


def prepare_data(d: DataConfig, *, progress: bool = False) -> tuple[Any, Path, Encoded, Encoded]:
    """The tokenizer (and its directory), the training set and the validation set of the ``data``
    section of a config, through the caches: :func:`prepare_tokenizer`, then :func:`cached_encode`
    of the validation split (small: bad data there shows early) and of the training split."""
    cache_dir = tokenizer_cache(d.cache_dir)
    tokenizer, tokenizer_dir = prepare_tokenizer(
        d.path, d.train_split, d.src, d.tgt, vocab_size=d.vocab_size, sample=d.tokenizer_sample,
        cache_dir=cache_dir, path=d.tokenizer, limit=d.limit, progress=progress,
    )  # fmt: skip
    val_set = cached_encode(
        tokenizer, tokenizer_dir, d.path, d.val_split, d.src, d.tgt, cache_dir=cache_dir, limit=d.val_limit,
        progress=progress,
    )  # fmt: skip
    train_set = cached_encode(
        tokenizer, tokenizer_dir, d.path, d.train_split, d.src, d.tgt, cache_dir=cache_dir, limit=d.limit,
        max_length=d.max_length, progress=progress,
    )  # fmt: skip
    return tokenizer, tokenizer_dir, train_set, val_set


def build_tokens(
    tokenizer: Any, directory: Path, key: str, inputs: dict[str, Any], source: str, split: str, src: str,
    tgt: str, *, chunk: int, progress: bool,
) -> None:  # fmt: skip
    """Encode the split into a new cache entry ``directory`` (see :func:`cached_encode`)."""
    from tqdm.auto import tqdm

    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(directory)
    prefix = f"{staging_prefix(directory)}{os.getpid()}."
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=directory.parent))
    lengths: dict[str, list[np.ndarray]] = {side: [] for side in SIDES}
    pairs = 0
    try:
        with contextlib.ExitStack() as files:
            ids = {side: files.enter_context(open(staging / f"{side}_ids.bin", "wb")) for side in SIDES}
            bar = files.enter_context(tqdm(desc=f"encoding {split}", unit=" pairs", disable=not progress))
            for sources, targets in stream_split(source, split, src, tgt, inputs["limit"], chunk):
                encoded = encode(tokenizer, sources, targets, max_length=inputs["max_length"])
                for side, side_ids, offsets in (
                    ("src", encoded.src_ids, encoded.src_offsets),
                    ("tgt", encoded.tgt_ids, encoded.tgt_offsets),
                ):
                    ids[side].write(side_ids.astype(np.int32).tobytes())
                    lengths[side].append(np.diff(offsets))
                pairs += len(sources)
                bar.update(len(sources))
        meta: dict[str, Any] = {"key": key, "inputs": inputs, "read": pairs}
        for side in SIDES:
            offsets = np.zeros(sum(map(len, lengths[side])) + 1, dtype=np.int64)
            np.cumsum(np.concatenate([np.zeros(0, np.int64), *lengths[side]]), out=offsets[1:])
            np.save(staging / f"{side}_offsets.npy", offsets)
            meta[side] = {"tokens": int(offsets[-1]), "offsets_sha256": sha256(offsets)}
        meta["pairs"] = len(offsets) - 1
        if meta["pairs"] < pairs:
            logger.info("dropped %d of %d pairs longer than %d tokens", pairs - meta["pairs"], pairs,
                        inputs["max_length"])  # fmt: skip
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            staging.rename(directory)  # the complete marker: nothing else names this directory
        except OSError:  # another process built the same entry first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_prefix(directory: Path) -> str:
    """Name prefix of the temporary directories that build ``directory`` on this host (then a pid)."""
    return f".{directory.name}.{socket.gethostname()}."


def remove_abandoned(directory: Path) -> None:
    """Remove temporary directories of ``directory`` left by builds on this host that died (a crash
    leaves one behind; it was never read). Builds still running keep theirs."""
    prefix = staging_prefix(directory)
    for staging in directory.parent.glob(f"{prefix}*"):
        pid = staging.name[len(prefix) :].split(".")[0]
        if pid.isdigit() and not running(int(pid)):
            logger.info("removing %s, left by a build that stopped", staging)
            shutil.rmtree(staging, ignore_errors=True)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def open_tokens(directory: Path, key: str) -> Encoded:
    """The cache entry ``directory``, memory-mapped; CacheError when anything does not check out."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("key") != key:
            raise CacheError(f"meta.json has key {meta.get('key')!r}, expected {key!r}")
        arrays: list[np.ndarray] = []
        for side in SIDES:
            tokens, pairs = int(meta[side]["tokens"]), int(meta["pairs"])
            offsets = np.load(directory / f"{side}_offsets.npy", mmap_mode="r")
            if offsets.shape != (pairs + 1,) or offsets.dtype != np.int64:
                found = f"{offsets.shape} {offsets.dtype}"
                raise CacheError(f"{side}_offsets.npy holds {found}, not {pairs + 1} int64")
            if sha256(offsets) != meta[side]["offsets_sha256"]:
                raise CacheError(f"{side}_offsets.npy does not match its hash in meta.json")
            if offsets[0] != 0 or offsets[-1] != tokens or (pairs and np.diff(offsets).min() < 1):
                raise CacheError(f"{side}_offsets.npy is not a partition of {tokens} token ids")
            path = directory / f"{side}_ids.bin"
            size = path.stat().st_size
            if size != tokens * 4:
                raise CacheError(f"{path.name} has {size} bytes, expected {tokens * 4} ({tokens} int32 ids)")
            ids = np.memmap(path, dtype=np.int32, mode="r") if tokens else np.zeros(0, dtype=np.int32)
            arrays += [ids, offsets]
    except (OSError, ValueError, KeyError, TypeError) as error:  # missing or malformed files
        raise CacheError(f"{type(error).__name__}: {error}") from None
    return Encoded(*arrays)


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
        # Python ints, not numpy scalars: this loop visits every example (4.5M for WMT14) per epoch.
        for position, length in enumerate(self.lengths[order].tolist()):
            longest_if_added = max(longest, length)
            if position > start and longest_if_added * (position - start + 1) > self.max_tokens:
                batches.append(order[start:position])
                start, longest_if_added = position, length
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
