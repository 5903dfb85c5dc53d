"""The ImageNet-like JPEG folder is what the image recipe reads, and the loader benchmark runs end to end
(issue 23, item 4): 12 training and 3 validation JPEGs in 3 classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers", reason="the image recipe needs pip install '.[recipes]'")

from benchmarks import imagenet_jpegs, imagenet_loader
from recipes.imagenet import data

CLASSES = ["n00000000", "n00000001", "n00000002"]


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("jpegs")
    return root, imagenet_jpegs.write(root, images=12, classes=3, val_per_class=1, seed=4)


def test_the_sizes_are_imagenets_mostly_500_by_375() -> None:
    sizes = imagenet_jpegs.image_sizes(20_000, np.random.default_rng(0))
    assert sizes.shape == (20_000, 2) and sizes.min() >= 90 and sizes.max() <= 1200
    assert abs(np.mean((sizes == (500, 375)).all(1)) - 0.45) < 0.02
    assert abs(np.mean((sizes == (375, 500)).all(1)) - 0.15) < 0.02
    assert 380 < sizes.mean(0)[0] < 480 and 330 < sizes.mean(0)[1] < 430  # ImageNet: about 400 x 350
    assert np.array_equal(sizes, imagenet_jpegs.image_sizes(20_000, np.random.default_rng(0)))


def test_the_folder_is_what_the_recipes_loader_reads(jpegs: tuple[Path, dict[str, Any]]) -> None:
    root, summary = jpegs
    train, val = data.open_splits(str(root), "train", "val")  # the recipe's reader, both splits checked
    assert train.classes == val.classes == CLASSES
    assert len(train) == 12 and len(val) == 3
    assert isinstance(train, data.ImageFolder)
    # the images were dealt to the classes in turn, and each has the size drawn for its index
    sizes = imagenet_jpegs.image_sizes(12, np.random.default_rng(4))
    labels = [label for _, label in train.samples]
    assert sorted(labels) == [0] * 4 + [1] * 4 + [2] * 4
    for index, (path, label) in enumerate(train.samples):
        image, loaded_label = train.load(index)
        number = int(path.stem.split("_")[1]) * 3 + label  # CLASS_I.JPEG holds training image I * 3 + label
        assert path.parent.name == CLASSES[label] and path.suffix == ".JPEG" and loaded_label == label
        assert image.mode == "RGB" and image.size == tuple(sizes[number])
        with Image.open(path) as file:
            assert file.format == "JPEG"
    assert summary["train"]["images"] == 12 and summary["val"]["images"] == 3
    assert summary["train"]["mean_kb"] > 20  # photo-like, not flat (about 110 KB at 500 x 375)
    pixels = np.asarray(train.load(0)[0], dtype=np.float32)
    assert pixels.std() > 20  # not flat


def test_the_loader_benchmark_runs_and_writes_its_report(
    jpegs: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, _ = jpegs
    out = tmp_path / "report"
    argv = [str(root), "--workers", "0", "1", "--batch", "2", "--repeats", "1", "--sample", "3"]
    argv += ["--out", str(out)]
    report = imagenet_loader.main(argv)
    assert json.loads(out.with_suffix(".json").read_text()) == report
    assert report["command"] == "python -m benchmarks.imagenet_loader " + " ".join(argv)
    assert sorted(report["images_per_s"]) == ["0", "1"] and report["settings"]["batches_per_pass"] == 6
    assert all(rate > 0 for rates in report["images_per_s"].values() for rate in rates)
    assert report["per_worker_images_per_s"] == round(report["images_per_s"]["1"][0], 1) > 0
    costs = report["per_image_ms"]
    assert 0 < costs["decode_ms"] < costs["decode_transform_ms"] and costs["transform_ms"] > 0
    assert report["data"]["images"] == 12 and report["data"]["mean_kb"] > 0
    assert all(need["workers"] >= 1 for need in report["workers_needed"].values())
    assert report["machine"]["cores"] and report["commit"]
    text = out.with_suffix(".md").read_text()
    assert f"**Per worker: {report['per_worker_images_per_s']:.1f} images/s**" in text
    assert "| decode (open, JPEG decode, RGB) |" in text
    with pytest.raises(SystemExit, match="--workers must include 1"):
        imagenet_loader.main([str(root), "--workers", "0", "2"])
