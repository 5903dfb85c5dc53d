"""One data argument, three kinds of source (recipes.common.sources), for both recipes' readers and both
eval scripts: plain files, a local `datasets` directory (save_to_disk, or parquet in the hub's layout)
and a hub name (datasets.load_dataset monkeypatched to hand back a local dataset: no network here)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("datasets", reason="local and hub datasets need pip install '.[recipes]'")
pytest.importorskip("transformers", reason="the recipes need pip install '.[recipes]'")
pytest.importorskip("sacrebleu", reason="eval.bleu needs pip install '.[recipes]'")

import datasets

from eval import accuracy, bleu, contract
from recipes.common import sources
from recipes.imagenet import data as image_data
from recipes.translation import data as text_data
from tests.test_accuracy import public_checkpoint  # noqa: F401 (the fixture of a classifier)
from tests.test_bleu import SOURCES, TARGETS, save_checkpoint, write_test_set


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_dataset("parquet") converts to Arrow under the datasets cache: keep it in the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def wmt_rows(pairs: list[tuple[str, str]], other: str = "de") -> Any:
    """A split in WMT14's layout: a `translation` column of {other: ..., "en": ...} dicts."""
    return datasets.Dataset.from_dict({"translation": [{other: t, "en": s} for s, t in pairs]})


def wmt_test_split() -> Any:
    return wmt_rows([*zip(SOURCES, TARGETS, strict=True), ("", "leer")])  # the empty pair is dropped


def saved_translations(root: Path) -> Path:
    datasets.DatasetDict({"test": wmt_test_split(), "train": wmt_rows([("a", "b")])}).save_to_disk(root)
    return root


def parquet_translations(root: Path) -> Path:
    """Two configs, as the hub's wmt/wmt14 parquet files: DIR/de-en/..., DIR/fr-en/..."""
    (root / "de-en").mkdir(parents=True)
    (root / "fr-en").mkdir()
    wmt_test_split().to_parquet(root / "de-en" / "test-00000-of-00001.parquet")
    wmt_rows([("a", "b")]).to_parquet(root / "de-en" / "train-00000-of-00001.parquet")
    wmt_rows([("one", "un")], other="fr").to_parquet(root / "fr-en" / "test-00000-of-00001.parquet")
    return root


def hub(monkeypatch: pytest.MonkeyPatch, dataset: Any) -> list[tuple[Any, ...]]:
    """datasets.load_dataset replaced by one that records its arguments and returns ``dataset``."""
    calls: list[tuple[Any, ...]] = []

    def load_dataset(name: str, config: str | None = None, *, split: str) -> Any:
        calls.append((name, config, split))
        return dataset

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


# Which kind ------------------------------------------------------------------------------------


def test_source_kind_and_the_parquet_layout(tmp_path: Path) -> None:
    kind = {"files": "F", "hub": "owner/name"}
    assert sources.source_kind(str(write_test_set(tmp_path / "files")), **kind) == "files"
    assert sources.source_kind(str(saved_translations(tmp_path / "saved")), **kind) == "saved"
    parquet = parquet_translations(tmp_path / "parquet")
    assert sources.source_kind(str(parquet), **kind) == "parquet"
    assert sources.source_kind("wmt/wmt14", **kind) == "hub"
    layout = sources.parquet_layout(parquet)
    assert sorted(layout) == ["de-en", "fr-en"] and sorted(layout["de-en"]) == ["test", "train"]
    (tmp_path / "flat" / "validation").mkdir(parents=True)
    wmt_rows([("a", "b")]).to_parquet(tmp_path / "flat" / "validation" / "0000.parquet")
    assert list(sources.parquet_layout(tmp_path / "flat")) == [""]  # the split's folder is no config
    assert list(sources.parquet_layout(tmp_path / "flat")[""]) == ["validation"]
    expected = r"expected a directory of F, a local `datasets` directory .* or a hub name owner/name"
    with pytest.raises(sources.DataError, match=rf"{tmp_path / 'nope'}: no such directory.*{expected}"):
        sources.source_kind(str(tmp_path / "nope"), **kind)
    with pytest.raises(sources.DataError, match=rf"test\.en is a file, not a dataset: {expected}"):
        sources.source_kind(str(tmp_path / "files" / "test.en"), **kind)


# Translation: the recipe's reader and eval.bleu ------------------------------------------------


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("seq2seq")
    save_checkpoint(out, seed=0)
    return out


@pytest.mark.parametrize("kind", ["files", "saved", "parquet", "hub"])
def test_translation_reader_and_eval_bleu_read_every_kind(
    kind: str, seq2seq: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "files":
        path = str(write_test_set(tmp_path / "files"))
    elif kind == "saved":
        path = str(saved_translations(tmp_path / "saved"))
    elif kind == "parquet":
        path = str(parquet_translations(tmp_path / "parquet"))
    else:
        path, calls = "wmt/wmt14", hub(monkeypatch, wmt_test_split())
    assert text_data.read_split(path, "test", "en", "de") == (SOURCES, TARGETS)
    assert text_data.read_split(path, "test", "de", "en", limit=2) == (TARGETS[:2], SOURCES[:2])
    argv = [str(seq2seq), "--data", path, "--split", "test", "--src", "en", "--tgt", "de", "--max-len-b", "2"]
    result = contract.main(bleu.parser(), bleu._evaluate, argv)  # the command line, in this process
    assert result["sentences"] == len(SOURCES) and result["data"] == path
    if kind == "hub":
        assert calls == [("wmt/wmt14", "de-en", "test")] * 3


def test_translation_errors_name_the_dataset_and_what_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    saved, parquet = saved_translations(tmp_path / "saved"), parquet_translations(tmp_path / "parquet")
    with pytest.raises(text_data.DataError, match=rf"{saved}: no split 'validation'; it has test, train"):
        text_data.read_split(str(saved), "validation", "en", "de")
    no_split = rf"{parquet / 'de-en'}: no split 'validation'; it has test, train"
    with pytest.raises(text_data.DataError, match=no_split):
        text_data.read_split(str(parquet), "validation", "en", "de")
    pairs = rf"unknown language pair en-cs for {parquet}: expected one of de-en, fr-en"
    with pytest.raises(text_data.DataError, match=pairs):
        text_data.read_split(str(parquet), "test", "en", "cs")
    languages = rf"{saved} \(split test\): its translation column has no fr; it has de, en"
    with pytest.raises(text_data.DataError, match=languages):
        text_data.read_split(str(saved), "test", "en", "fr")
    text = datasets.Dataset.from_dict({"text": ["a"]})
    text.save_to_disk(tmp_path / "one")
    with pytest.raises(text_data.DataError, match=r"holds one Dataset \(split unnamed\), not split 'test'"):
        text_data.read_split(str(tmp_path / "one"), "test", "en", "de")
    datasets.DatasetDict({"test": text}).save_to_disk(tmp_path / "text")
    column = rf"{tmp_path / 'text'} \(split test\): no column 'translation' \(expected a .*\); it has text"
    with pytest.raises(text_data.DataError, match=column):
        text_data.read_split(str(tmp_path / "text"), "test", "en", "de")
    with pytest.raises(text_data.DataError, match=r"unknown language pair en-ja for wmt/wmt14: .*de-en"):
        text_data.read_split("wmt/wmt14", "test", "en", "ja")

    def unknown_split(name: str, config: str | None = None, *, split: str) -> Any:
        raise ValueError(f"Unknown split \"{split}\". Should be one of ['train', 'validation', 'test'].")

    monkeypatch.setattr(datasets, "load_dataset", unknown_split)
    hub_split = r"wmt/wmt14 \(config de-en, split dev\): not a local directory, .*Should be one of"
    with pytest.raises(text_data.DataError, match=hub_split):
        text_data.read_split("wmt/wmt14", "dev", "en", "de")
    # eval.bleu: a data error is exit code 3 with the reader's message
    with pytest.raises(SystemExit) as stopped:
        argv = ["unused", "--data", str(saved), "--split", "dev", "--src", "en", "--tgt", "de"]
        contract.main(bleu.parser(), bleu._evaluate, argv)
    assert stopped.value.code == 3
    assert f"error: {saved}: no split 'dev'; it has test, train" in capsys.readouterr().err


# Images: the recipe's reader and eval.accuracy --------------------------------------------------


CLASSES = ["cat", "dog", "fox"]


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_rows(count: int, seed: int = 0) -> Any:
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    rows = {
        "image": [{"bytes": png(seed + i), "path": None} for i in range(count)],
        "label": [i % len(CLASSES) for i in range(count)],
    }
    return datasets.Dataset.from_dict(rows, features=features)


def image_dataset(kind: str, root: Path) -> str:
    """A train (6 images) and validation (3 images) split of the given kind."""
    splits = {"train": image_rows(6), "validation": image_rows(3, seed=100)}
    if kind == "saved":
        datasets.DatasetDict(splits).save_to_disk(root)
    elif kind == "parquet":  # ILSVRC/imagenet-1k's layout: DIR/data/SPLIT-00000-of-0000N.parquet
        (root / "data").mkdir(parents=True)
        for split, rows in splits.items():
            rows.to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    else:
        for split, rows in splits.items():
            for index, row in enumerate(rows):
                (root / split / CLASSES[row["label"]]).mkdir(parents=True, exist_ok=True)
                row["image"].save(root / split / CLASSES[row["label"]] / f"{index}.png")
    return str(root)


@pytest.mark.parametrize("kind", ["files", "saved", "parquet", "hub"])
def test_image_reader_and_eval_accuracy_read_every_kind(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    classifier = request.getfixturevalue("public_checkpoint")
    if kind == "hub":
        path, calls = "ILSVRC/imagenet-1k", hub(monkeypatch, image_rows(3, seed=100))
    else:
        path = image_dataset(kind, tmp_path / kind)
    val = image_data.open_split(path, "validation")
    image, label = val.load(1)
    assert val.classes == CLASSES and len(val) == 3 and label == 1 and image.mode == "RGB"
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(png(101)))))
    if kind != "hub":
        train, _ = image_data.open_splits(path, "train", "validation")
        assert len(train) == 6
    argv = [str(classifier), "--data", path, "--split", "validation", "--batch-size", "2"]
    result = contract.main(accuracy.parser(), accuracy._evaluate, argv)
    assert result["images"] == 3 and result["classes"] == 3
    assert result["label_mapping"] == "sorted-folder-order"
    if kind == "hub":
        assert calls == [("ILSVRC/imagenet-1k", None, "validation")] * 2


def test_image_errors_name_the_dataset_and_what_it_has(tmp_path: Path) -> None:
    saved = image_dataset("saved", tmp_path / "saved")
    with pytest.raises(image_data.DataError, match=rf"{saved}: no split 'val'; it has train, validation"):
        image_data.open_split(saved, "val")
    parquet = image_dataset("parquet", tmp_path / "parquet")
    no_split = rf"{Path(parquet) / 'data'}: no split 'test'; it has train, validation"
    with pytest.raises(image_data.DataError, match=no_split):
        image_data.open_split(parquet, "test")
    unlabelled = datasets.DatasetDict({"train": image_rows(2).remove_columns("label")})
    unlabelled.save_to_disk(tmp_path / "unlabelled")
    column = r"unlabelled \(split train\): no column 'label' \(expected a class index .*\); it has image"
    with pytest.raises(image_data.DataError, match=column):
        image_data.open_split(str(tmp_path / "unlabelled"), "train")
    plain = image_rows(2).cast_column("label", datasets.Value("int64"))
    datasets.DatasetDict({"train": plain}).save_to_disk(tmp_path / "plain")
    with pytest.raises(image_data.DataError, match=r"not a ClassLabel with class names; cast it"):
        image_data.open_split(str(tmp_path / "plain"), "train")
    broken = datasets.Dataset.from_dict(
        {"image": [{"bytes": b"not a png", "path": None}], "label": [0]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)}),
    )
    datasets.DatasetDict({"train": broken}).save_to_disk(tmp_path / "broken")
    with pytest.raises(image_data.UnreadableImage, match=r"broken train row 0: cannot read its image"):
        image_data.open_split(str(tmp_path / "broken"), "train").load(0)
    with pytest.raises(image_data.DataError, match=r"no such directory, and not a hub name"):
        image_data.open_split(str(tmp_path / "missing"), "train")


# Issue 23's "bad inputs" and "each source kind for each script", as a matrix ---------------------
#
# Each bad input (an unknown split, a missing column, a language pair the data lacks) of each source
# kind stops the recipe's reader and the eval script with a message that names the dataset, the split
# or column, and what is expected or present. The hub is datasets.load_dataset answered from local
# parquet files by datasets' own parquet loader, so its errors (an unknown split) are the library's.


def hub_from_parquet(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[tuple[Any, ...]]:
    """datasets.load_dataset(name, config, split=...) replaced by the real parquet loader on ``root``'s
    files of that config (the hub's layout); the calls are recorded."""
    original, layout = datasets.load_dataset, sources.parquet_layout(root)
    calls: list[tuple[Any, ...]] = []

    def load_dataset(name: str, config: str | None = None, *, split: str) -> Any:
        calls.append((name, config, split))
        files = layout[config] if config else next(iter(layout.values()))  # the only config there is
        return original("parquet", data_files=files, split=split)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def unlabelled_images(kind: str, root: Path) -> str:
    """Train and validation splits with an `image` column and no `label` column."""
    splits = {
        "train": image_rows(3).remove_columns("label"),
        "validation": image_rows(3).remove_columns("label"),
    }
    if kind == "saved":
        datasets.DatasetDict(splits).save_to_disk(root)
        return str(root)
    (root / "data").mkdir(parents=True)
    for split, rows in splits.items():
        rows.to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    return str(root)


IMAGE_ERRORS = [
    ("files", "split"),
    *((k, p) for k in ("saved", "parquet", "hub") for p in ("split", "column")),
]
"""An image folder has no columns: its files are checked by tests/test_imagenet_data.py."""


@pytest.mark.parametrize(("kind", "problem"), IMAGE_ERRORS)
def test_image_reader_and_eval_accuracy_name_the_dataset_the_split_or_column_and_what_is_expected(
    kind: str,
    problem: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    local = tmp_path / kind
    made = unlabelled_images if problem == "column" else image_dataset
    path = made("parquet" if kind == "hub" else kind, local)
    if kind == "hub":
        path, calls = "ILSVRC/imagenet-1k", hub_from_parquet(monkeypatch, local)
    split = "test" if problem == "split" else "validation"
    column = f"{path} (split validation): no column 'label' (expected a class index per row (a ClassLabel));"
    expected = {
        ("files", "split"): re.escape(f"{local / 'test'}: no such folder (expected split 'test' as a folder ")
        + re.escape(f"with one sub-folder of images per class; {local} has train, validation)"),
        ("saved", "split"): re.escape(f"{local}: no split 'test'; it has train, validation"),
        ("parquet", "split"): re.escape(f"{local / 'data'}: no split 'test'; it has train, validation"),
        ("hub", "split"): r"ILSVRC/imagenet-1k \(split test\): not a local directory, so read as a hub name, "
        + r".*Unknown split \"test\"\. Should be one of \['train', 'validation'\]",
    }.get((kind, problem), re.escape(column) + " it has image")
    with pytest.raises(image_data.DataError, match=expected):
        image_data.open_split(path, split)
    with pytest.raises(SystemExit) as stopped:  # the command line, in this process: data errors exit 3
        contract.main(accuracy.parser(), accuracy._evaluate, ["unused", "--data", path, "--split", split])
    assert stopped.value.code == 3
    assert re.search("error: " + expected, capsys.readouterr().err)
    if kind == "hub":
        assert calls == [("ILSVRC/imagenet-1k", None, split)] * 2


def text_without_translations(kind: str, root: Path) -> str:
    """A `test` split with a `text` column instead of `translation` (parquet: in a de-en config)."""
    text = datasets.Dataset.from_dict({"text": ["a", "b"]})
    if kind == "saved":
        datasets.DatasetDict({"test": text}).save_to_disk(root)
        return str(root)
    (root / "de-en").mkdir(parents=True)
    text.to_parquet(root / "de-en" / "test-00000-of-00001.parquet")
    return str(root)


TEXT_ERRORS = [(k, p) for k in ("files", "saved", "parquet", "hub") for p in ("split", "column", "pair")]
TEXT_ERRORS.remove(("files", "column"))  # plain text files have no columns


@pytest.mark.parametrize(("kind", "problem"), TEXT_ERRORS)
def test_translation_reader_and_eval_bleu_name_the_dataset_the_split_column_or_pair_and_what_is_expected(
    kind: str,
    problem: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    local = tmp_path / kind
    if problem == "column":
        path = text_without_translations("parquet" if kind == "hub" else kind, local)
    elif kind == "files":
        path = str(write_test_set(local))
    elif kind == "saved":
        path = str(saved_translations(local))
    else:
        path = str(parquet_translations(local))
    if kind == "hub":
        path, calls = "wmt/wmt14", hub_from_parquet(monkeypatch, local)
    split = "dev" if problem == "split" else "test"
    tgt = {"files": "fr", "saved": "fr", "parquet": "cs", "hub": "ja"}[kind] if problem == "pair" else "de"
    expected = {
        ("files", "split"): re.escape(f"missing data file {local / 'dev.en'} (or dev.en.gz): ")
        + r".*there is no dev\.\* file",
        ("files", "pair"): re.escape(f"missing data file {local / 'test.fr'} (or test.fr.gz): ")
        + ".*test exists in de, en",
        ("saved", "split"): re.escape(f"{local}: no split 'dev'; it has test, train"),
        ("saved", "column"): re.escape(f"{local} (split test): no column 'translation' (expected a "),
        ("saved", "pair"): re.escape(
            f"{local} (split test): its translation column has no fr; it has de, en"
        ),
        ("parquet", "split"): re.escape(f"{local / 'de-en'}: no split 'dev'; it has test, train"),
        ("parquet", "column"): re.escape(f"{local} (split test): no column 'translation' (expected a "),
        ("parquet", "pair"): re.escape(
            f"unknown language pair en-cs for {local}: expected one of de-en, fr-en"
        ),
        ("hub", "split"): re.escape("wmt/wmt14 (config de-en, split dev): not a local directory, so read as")
        + r".*Unknown split \"dev\"\. Should be one of \['test', 'train'\]",
        ("hub", "column"): re.escape("wmt/wmt14 (split test): no column 'translation' (expected a "),
        ("hub", "pair"): re.escape(
            "unknown language pair en-ja for wmt/wmt14: expected one of cs-en, de-en,"
        ),
    }[(kind, problem)]
    with pytest.raises(text_data.DataError, match=expected):
        text_data.read_split(path, split, "en", tgt)
    argv = ["unused", "--data", path, "--split", split, "--src", "en", "--tgt", tgt]
    with pytest.raises(SystemExit) as stopped:  # the command line, in this process: data errors exit 3
        contract.main(bleu.parser(), bleu._evaluate, argv)
    assert stopped.value.code == 3
    assert re.search("error: " + expected, capsys.readouterr().err)
    if kind == "hub" and problem != "pair":  # an unknown pair stops before anything is loaded
        assert calls == [("wmt/wmt14", "de-en", split)] * 2


@pytest.mark.parametrize("kind", ["parquet", "hub"])
def test_image_recipe_trains_and_eval_accuracy_scores_on_imagenet_1k_layout(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``data=ILSVRC/imagenet-1k data.val_split=validation``, the README's command, on parquet files in
    the hub's layout (`image`, `label` columns): the recipe's whole loading path (both splits, the
    training transform, a loader worker holding the datasets table), one step, an evaluation, a
    checkpoint that eval.accuracy scores on the same data."""
    pytest.importorskip("accelerate", reason="the recipes need pip install '.[recipes]'")
    pytest.importorskip("tensorboard", reason="the recipes log to TensorBoard")
    from recipes.imagenet import train as image_train

    path = image_dataset("parquet", tmp_path / "parquet")
    if kind == "hub":
        path, calls = "ILSVRC/imagenet-1k", hub_from_parquet(monkeypatch, tmp_path / "parquet")
    run = tmp_path / "run"
    image_train.main([
        "--preset", "mnist-resnet-small-allreduce", f"data={path}", "data.val_split=validation",
        "data.num_workers=1", "data.image_size=16", "model.embedding_size=8",
        "model.hidden_sizes=[8, 8, 8, 8]", "train.global_batch=2", "train.val_batch=3", "train.max_steps=1",
        "train.mixed_precision=no", f"train.output_dir={run}",
    ])  # fmt: skip
    evaluation = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert evaluation["step"] == 1 and 0.0 <= evaluation["top1"] <= 1.0
    argv = [str(run / "step-1"), "--data", path, "--split", "validation", "--batch-size", "2"]
    result = contract.main(accuracy.parser(), accuracy._evaluate, argv)
    assert result["images"] == 3 and result["classes"] == 3 and result["label_mapping"] == "names"
    if kind == "hub":  # training reads both splits, eval.accuracy the validation split
        assert calls == [("ILSVRC/imagenet-1k", None, s) for s in ("train", "validation", "validation")]
