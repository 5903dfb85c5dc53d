"""The translation recipe's token cache (issue 23, item 2): built once by the main process, opened
memory-mapped by the others, equal to the direct encoding, rebuilt (never trusted) when partial or
corrupt, keyed by everything that changes its content. And the tokenizer's bounded sample."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tqdm import tqdm

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("transformers", reason="the translation recipe needs pip install '.[recipes]'")

from benchmarks import wmt_corpus
from recipes.translation import data, synthetic
from tests.distributed_harness import run_distributed

VOCAB = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write(tmp_path_factory.mktemp("synthetic"), train=1500, val=50, test=50)


@pytest.fixture(scope="module")
def tokenizer(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    cache = tmp_path_factory.mktemp("tokenizer")
    return data.prepare_tokenizer(
        str(corpus), "train", "en", "de", vocab_size=VOCAB, sample=0, cache_dir=cache
    )


def cached(tokenizer: tuple[Any, Path], corpus: Path, cache: Path, **settings: Any) -> data.Encoded:
    settings = {"split": "train", "max_length": 20, "chunk": 400, **settings}
    split = settings.pop("split")
    return data.cached_encode(*tokenizer, str(corpus), split, "en", "de", cache_dir=cache, **settings)


def assert_same(a: data.Encoded, b: data.Encoded) -> None:
    for name in ("src_ids", "src_offsets", "tgt_ids", "tgt_offsets"):
        np.testing.assert_array_equal(
            np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name
        )


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("tokens-*"))


def test_cache_equals_the_direct_encoding_and_is_built_once(
    corpus: Path, tokenizer: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources, targets = data.read_split(str(corpus), "train", "en", "de")
    # With the whole split as its sample, the tokenizer is the one the old path trained on all text.
    old, _ = data.build_tokenizer([sources, targets], VOCAB, tmp_path / "old")
    assert old.get_vocab() == tokenizer[0].get_vocab()
    direct = data.encode(tokenizer[0], sources, targets, max_length=20)
    everything = data.encode(tokenizer[0], sources, targets)
    called = tokenizer[0](targets, add_special_tokens=True)["input_ids"]  # what encode used to call
    assert np.array_equal(everything.tgt_ids, np.concatenate(called)) and len(everything) == len(called)
    first = cached(tokenizer, corpus, tmp_path)  # 4 chunks of 400 pairs
    assert isinstance(first.src_ids, np.memmap) and 0 < len(first) < len(sources)
    assert_same(first, direct)
    limited = cached(tokenizer, corpus, tmp_path, limit=700, max_length=0)
    assert_same(limited, data.encode(tokenizer[0], sources[:700], targets[:700]))

    def no_encoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cache should have been opened, not built again")

    monkeypatch.setattr(data, "encode", no_encoding)
    monkeypatch.setattr(data, "stream_split", no_encoding)
    assert_same(cached(tokenizer, corpus, tmp_path), direct)
    assert len(entries(tmp_path)) == 2
    batch = data.collate(first, np.array([0, 5]), pad_id=0)  # collate reads slices of the memory maps
    assert batch["attention_mask"].sum(1).tolist() == first.src_lengths[[0, 5]].tolist()


def build_on_rank_0(rank: int, world_size: int, corpus: str, cache: str) -> dict[str, Any]:
    """What the recipe does: rank 0 first (it builds), then the others (they open); count the reads."""
    import torch.distributed as dist

    reads: list[str] = []
    stream = data.stream_split

    def counted(source: str, split: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(split)
        return stream(source, split, *args, **kwargs)

    data.stream_split = counted  # type: ignore[assignment]  # this spawned process only
    if rank != 0:
        dist.barrier()
    tokenizer = data.prepare_tokenizer(
        corpus, "train", "en", "de", vocab_size=VOCAB, sample=500, cache_dir=cache
    )
    encoded = cached(tokenizer, Path(corpus), Path(cache))
    if rank == 0:
        dist.barrier()
    arrays = {name: np.asarray(getattr(encoded, name)).tolist() for name in ("src_ids", "tgt_offsets")}
    return {"reads": reads, "mapped": isinstance(encoded.src_ids, np.memmap), **arrays}


def test_only_the_main_process_reads_and_encodes_the_others_map_its_cache(
    corpus: Path, tmp_path: Path
) -> None:
    main, other = run_distributed(build_on_rank_0, 2, str(corpus), str(tmp_path), timeout_s=90)
    assert main["reads"] == ["train", "train"]  # the tokenizer's sample, then the encoding
    assert other["reads"] == [] and other["mapped"]
    assert other["src_ids"] == main["src_ids"] and other["tgt_offsets"] == main["tgt_offsets"]
    assert len(entries(tmp_path)) == 1 and len(list(tmp_path.glob("tokenizer-*"))) == 1


def truncate_ids(entry: Path) -> None:
    path = entry / "src_ids.bin"
    path.write_bytes(path.read_bytes()[:-4])


def drop_offsets(entry: Path) -> None:
    (entry / "tgt_offsets.npy").unlink()


def edit_meta(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["pairs"] -= 1
    (entry / "meta.json").write_text(json.dumps(meta))


def garble_meta(entry: Path) -> None:
    (entry / "meta.json").write_text('{"key": ')


def shuffle_offsets(entry: Path) -> None:  # same size and header, other content
    offsets = np.load(entry / "src_offsets.npy")
    offsets[1], offsets[2] = offsets[2], offsets[1]
    np.save(entry / "src_offsets.npy", offsets)


@pytest.mark.parametrize("damage", [truncate_ids, drop_offsets, edit_meta, garble_meta, shuffle_offsets])
def test_a_corrupt_cache_is_rebuilt_with_a_warning(
    damage: Any, corpus: Path, tokenizer: tuple[Any, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fresh = cached(tokenizer, corpus, tmp_path / "fresh", split="val")
    first = cached(tokenizer, corpus, tmp_path, split="val")
    (entry,) = entries(tmp_path)
    del first
    damage(entry)
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        rebuilt = cached(tokenizer, corpus, tmp_path, split="val")
    assert "cannot be trusted" in caplog.text and str(entry) in caplog.text
    assert_same(rebuilt, fresh)
    assert entries(tmp_path) == [entry]


def test_a_partial_cache_is_ignored_and_a_dead_build_s_directory_removed(
    corpus: Path, tokenizer: tuple[Any, Path], tmp_path: Path
) -> None:
    fresh = cached(tokenizer, corpus, tmp_path / "fresh", split="val")
    (entry,) = entries(tmp_path / "fresh")
    # A build that crashed: its temporary directory, with the final files' names, under a dead pid;
    # and one of a build still running (this process's pid), which must be left alone.
    dead, alive = 2**22 + 1, os.getpid()
    for pid in (dead, alive):
        staging = tmp_path / f"{data.staging_prefix(entry)}{pid}.x1"
        staging.mkdir(parents=True)
        (staging / "meta.json").write_text("{}")
    assert_same(cached(tokenizer, corpus, tmp_path, split="val"), fresh)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == [f"{data.staging_prefix(entry)}{alive}.x1"]


def test_changed_inputs_give_another_entry(corpus: Path, tokenizer: tuple[Any, Path], tmp_path: Path) -> None:
    copy = tmp_path / "data"
    copy.mkdir()
    for name in ("train.en.gz", "train.de.gz"):
        (copy / name).write_bytes((corpus / name).read_bytes())
    cache = tmp_path / "cache"
    base = cached(tokenizer, copy, cache)
    cached(tokenizer, copy, cache, max_length=30)
    cached(tokenizer, copy, cache, limit=100)
    other = data.prepare_tokenizer(
        str(copy), "train", "en", "de", vocab_size=250, sample=0, cache_dir=tmp_path
    )
    cached(other, copy, cache)
    assert len(entries(cache)) == 4
    with gzip.open(copy / "train.de.gz", "rt", encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    with gzip.open(copy / "train.de.gz", "wt", encoding="utf-8") as handle:
        handle.write("\n".join(["Ein anderer Satz.", *lines[1:]]) + "\n")
    changed = cached(tokenizer, copy, cache)
    assert len(entries(cache)) == 5 and not np.array_equal(changed.tgt_ids[:5], base.tgt_ids[:5])


def test_the_tokenizer_sample_is_uniform_the_same_every_time_and_bounded() -> None:
    pairs = [(f"s{i}", f"t{i}") for i in range(1000)]

    def chunks(size: int) -> list[tuple[list[str], list[str]]]:
        return [
            ([s for s, _ in pairs[i : i + size]], [t for _, t in pairs[i : i + size]])
            for i in range(0, 1000, size)
        ]

    expected = sorted(np.argsort(np.random.default_rng(0).random(1000))[:100].tolist())  # bottom-k
    for size in (7, 100, 1000):
        sources, targets, total = data.sample_pairs(chunks(size), 100)
        assert (
            total == 1000
            and sources == [f"s{i}" for i in expected]
            and targets == [f"t{i}" for i in expected]
        )
    with tqdm(file=io.StringIO(), mininterval=0, miniters=1) as bar:  # a bar that refreshes every time
        assert list(data.counted(chunks(64), bar)) == chunks(64) and bar.n == 1000
    everything = data.sample_pairs(chunks(64), 0)
    assert everything == ([s for s, _ in pairs], [t for _, t in pairs], 1000)
    assert (
        data.sample_pairs(chunks(64), 5000)[0] == everything[0]
    )  # fewer pairs than the sample: all, in order


def test_streamed_reading_equals_reading_at_once(corpus: Path) -> None:
    whole = data.read_split(str(corpus), "train", "en", "de")
    for limit in (0, 333, 400):
        chunks = list(data.stream_split(str(corpus), "train", "en", "de", limit=limit, chunk=100))
        sources = [s for c, _ in chunks for s in c]
        targets = [t for _, c in chunks for t in c]
        end = limit or len(whole[0])
        assert (sources, targets) == (whole[0][:end], whole[1][:end])


def test_wmt_corpus_writes_the_layout_the_recipe_reads(tmp_path: Path) -> None:
    wmt_corpus.main(["--out", str(tmp_path), "--pairs", "2000", "--held-out", "20", "--seed", "1"])
    sources, targets = data.read_split(str(tmp_path), "train", "en", "de")
    assert len(sources) == len(targets) == 2000
    assert len(data.read_split(str(tmp_path), "val", "en", "de")[0]) == 20
    words = np.array([len(s.split()) for s in sources])
    assert 20 < words.mean() < 26 and words.max() > 60 and words.min() >= 1
    assert len({w for s in sources for w in s.split()}) > 3000  # a Zipfian vocabulary, not a handful
