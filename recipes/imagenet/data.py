"""Images in, tensors out: image folders or the hub, the transforms, and each rank's batches.

Sources (``recipes.common.sources``). An image folder is ``ROOT/train/CLASS/*.jpg`` and
``ROOT/val/CLASS/*.jpg`` (one sub-folder per class, the class index is the position of its name in
sorted order, as torchvision's ``ImageFolder``); a local ``datasets`` directory (``save_to_disk``,
or parquet files in the hub's layout, ``ROOT/data/train-00000-of-01024.parquet``) or a hub name
(``ILSVRC/imagenet-1k``) is read with ``datasets``, imported only then, and needs an ``image`` and
a ``label`` (ClassLabel) column.

Order. The training order of an epoch is a permutation drawn from ``(seed, epoch)``; step ``s`` of
the epoch takes the ``s``-th block of ``global_batch`` indices and rank ``r`` its ``r``-th slice, so
the ranks' shards are disjoint and every rank takes the same number of steps (the last incomplete
global batch is dropped). Each image's augmentation draws from its own generator seeded with
``(seed, epoch, index)``: the batches and their pixels depend neither on the number of DataLoader
workers nor on where training stopped, so resuming at batch ``b`` of an epoch is exact.

Bad input stops with a :class:`DataError` that names the path: a missing split folder, a split
without class folders, a class folder without images, train and val with different classes, and an
image that cannot be decoded. An unreadable image stops training rather than being skipped: skipping
silently changes the data set (a truncated copy of ImageNet would train on fewer images without a
trace), and a skip made inside one rank's loader worker would change that rank's batch size alone.
Fix or delete the file and resume from the last checkpoint.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from recipes.common import sources as data_sources

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)
TORCHVISION = importlib.util.find_spec("torchvision") is not None
"""Whether torchvision does the resizing (users with GPUs have it); else PIL does, with the same crops."""

Key = tuple[int, int]
"""(epoch, index): what the samplers hand the dataset, so that augmentation is seeded per image."""


DataError = data_sources.DataError
"""Input that cannot be trained on; the message names the path and what is wrong with it."""


class UnreadableImage(DataError):
    """An image file (or hub row) that cannot be decoded; raised by the one rank that meets it."""


class ImageSource(Protocol):
    """A split: class names, a length, and the decoded RGB image and class index of each item."""

    classes: list[str]

    def __len__(self) -> int: ...

    def load(self, index: int) -> tuple[Image.Image, int]: ...


# Sources -----------------------------------------------------------------------------------------


class ImageFolder:
    """``split_dir/CLASS/IMAGE``; files whose extension is not an image's are ignored."""

    def __init__(self, split_dir: str | Path) -> None:
        self.root = Path(split_dir)
        if not self.root.is_dir():
            splits = [p.name for p in _folders(self.root.parent)]
            raise DataError(
                f"{self.root}: no such folder (expected split {self.root.name!r} as a folder with one "
                f"sub-folder of images per class; {self.root.parent} has {', '.join(splits) or 'no folders'})"
            )
        class_dirs = _folders(self.root)
        if not class_dirs:
            raise DataError(f"{self.root}: no class folders in it (expected {self.root}/CLASS/IMAGE.jpg)")
        self.classes = [p.name for p in class_dirs]
        self.samples: list[tuple[Path, int]] = []
        for label, class_dir in enumerate(class_dirs):
            images = sorted(
                p for p in class_dir.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
            )
            if not images:
                raise DataError(
                    f"{class_dir}: class folder without images (none of "
                    f"{', '.join(sorted(IMAGE_EXTENSIONS))}); delete it or add its images, in every split"
                )
            self.samples.extend((path, label) for path in images)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[Image.Image, int]:
        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                return image.convert("RGB"), label
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise UnreadableImage(
                f"{path}: cannot read this image ({type(error).__name__}: {error}). Training stops rather "
                "than skip it; fix or delete the file, then resume from the last checkpoint."
            ) from None


def _folders(path: Path) -> list[Path]:
    """The sub-folders of ``path`` in sorted order, hidden ones left out; none if it is no folder."""
    return (
        sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        if path.is_dir()
        else []
    )


class DatasetImages:
    """A split of a ``datasets`` Dataset (from the hub, ``save_to_disk`` or parquet files) with an
    ``image`` column (decoded PIL images, or ``{"bytes", "path"}`` dicts) and a ``label`` column of
    class indices whose feature is a ``ClassLabel`` (it names the classes)."""

    def __init__(self, name: str, split: str, rows: Any) -> None:
        data_sources.require_columns(
            rows, name, split, {"image": "an image per row", "label": "a class index per row (a ClassLabel)"}
        )
        self.name, self.split, self.rows = name, split, rows
        label = rows.features["label"]
        self.classes = [str(c) for c in getattr(label, "names", None) or []]
        if not self.classes:
            raise DataError(
                f"{name} (split {split}): its 'label' column is {label}, not a ClassLabel with class names; "
                "cast it: dataset.cast_column('label', datasets.ClassLabel(names=[...]))"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def load(self, index: int) -> tuple[Image.Image, int]:
        try:
            row = self.rows[index]  # decodes an Image feature
            image = row["image"]
            if isinstance(image, dict):  # an undecoded Image feature, or a plain struct column
                opened = Image.open(io.BytesIO(image["bytes"]) if image.get("bytes") else image["path"])
                with opened:
                    return opened.convert("RGB"), int(row["label"])
            return image.convert("RGB"), int(row["label"])
        except (OSError, SyntaxError, ValueError, TypeError, KeyError, Image.DecompressionBombError) as error:
            raise UnreadableImage(
                f"{self.name} {self.split} row {index}: cannot read its image ({type(error).__name__}: "
                f"{error}); expected a PIL image or a {{'bytes', 'path'}} dict"
            ) from None


def open_split(path: str, split: str) -> ImageSource:
    """``split`` of an image folder (``path/split/CLASS/IMAGE``), of a local ``datasets`` directory
    (``save_to_disk`` or parquet files) or of a hub dataset (``org/name``): the one reader of
    training and ``eval.accuracy``."""
    kind = data_sources.source_kind(path, files="SPLIT/CLASS/IMAGE folders", hub="ILSVRC/imagenet-1k")
    if kind == "files":
        return ImageFolder(Path(path) / split)
    return DatasetImages(path, split, data_sources.load_split(path, kind, split))


def open_splits(path: str, train_split: str, val_split: str) -> tuple[ImageSource, ImageSource]:
    """The training and validation splits of a folder or hub dataset, checked to have the same classes."""
    train, val = open_split(path, train_split), open_split(path, val_split)
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise DataError(
            f"{path}: {train_split} and {val_split} have different classes "
            f"(only in {train_split}: {_few(only_train)}; only in {val_split}: {_few(only_val)}"
            + ("; the same names in another order" if not only_train and not only_val else "")
            + "): the class index of an image would differ between them"
        )
    return train, val


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") or "none"


# Transforms --------------------------------------------------------------------------------------


def crop_box(
    width: int, height: int, scale: Sequence[float], ratio: Sequence[float], rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """(left, top, crop width, crop height) of a random resized crop: torchvision's algorithm
    (10 tries at an area in ``scale`` and a log-uniform aspect ratio in ``ratio``, else a centre
    crop at the nearest allowed ratio), drawing from ``rng``."""
    area = width * height
    log_ratio = np.log(ratio[0]), np.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = float(np.exp(rng.uniform(*log_ratio)))
        w = round(float(np.sqrt(target * aspect)))
        h = round(float(np.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    aspect = width / height
    if aspect < min(ratio):
        w, h = width, round(width / min(ratio))
    elif aspect > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _to_tensor(image: Image.Image, mean: Tensor, std: Tensor) -> Tensor:
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)  # (3, H, W)
    return (pixels - mean) / std


@dataclass(frozen=True)
class TrainTransform:
    """Random resized crop to ``size`` x ``size``, horizontal flip with probability ``hflip``,
    scale to [0, 1] and normalise: a float32 tensor (3, size, size)."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (0.75, 4.0 / 3.0)
    hflip: float = 0.5
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    torchvision: bool = TORCHVISION

    def __call__(self, image: Image.Image, rng: np.random.Generator | None = None) -> Tensor:
        rng = rng if rng is not None else np.random.default_rng()
        left, top, w, h = crop_box(image.width, image.height, self.scale, self.ratio, rng)
        flip = bool(rng.random() < self.hflip)
        mean, std = torch.tensor(self.mean).view(3, 1, 1), torch.tensor(self.std).view(3, 1, 1)
        if self.torchvision:
            from torchvision.transforms.v2 import functional as tvf

            pixels = tvf.pil_to_tensor(image)  # (3, H, W) uint8
            pixels = tvf.resized_crop(pixels, top, left, h, w, [self.size, self.size], antialias=True)
            pixels = tvf.horizontal_flip(pixels) if flip else pixels
            normalised: Tensor = (pixels.float() / 255.0 - mean) / std
            return normalised
        box = (left, top, left + w, top + h)
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image
        return _to_tensor(image, mean, std)


@dataclass(frozen=True)
class EvalTransform:
    """Resize the shorter side to ``int(size / crop_pct)`` (bicubic), centre-crop ``size`` x ``size``,
    scale and normalise: what the saved ``ConvNextImageProcessor`` does, so that ``eval.accuracy``
    scores a checkpoint on the same pixels as training's evaluation."""

    size: int
    crop_pct: float = 0.875
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    torchvision: bool = TORCHVISION

    def __call__(self, image: Image.Image, rng: np.random.Generator | None = None) -> Tensor:
        short = int(self.size / self.crop_pct)
        if image.width <= image.height:
            width, height = short, int(short * image.height / image.width)
        else:
            width, height = int(short * image.width / image.height), short
        left, top = (width - self.size) // 2, (height - self.size) // 2
        mean, std = torch.tensor(self.mean).view(3, 1, 1), torch.tensor(self.std).view(3, 1, 1)
        if self.torchvision:
            from torchvision.transforms.v2 import functional as tvf

            pixels = tvf.pil_to_tensor(image)
            pixels = tvf.resize(
                pixels, [height, width], interpolation=tvf.InterpolationMode.BICUBIC, antialias=True
            )
            pixels = pixels[:, top : top + self.size, left : left + self.size]
            normalised: Tensor = (pixels.float() / 255.0 - mean) / std
            return normalised
        image = image.resize((width, height), Image.Resampling.BICUBIC)
        image = image.crop((left, top, left + self.size, top + self.size))
        return _to_tensor(image, mean, std)


def image_processor(size: int, crop_pct: float, mean: Sequence[float], std: Sequence[float]) -> Any:
    """The Hugging Face image processor saved with each checkpoint: the evaluation transform above."""
    import transformers

    # Without torchvision, transformers 5 falls back (with a warning) to the PIL class; ask for it directly.
    kind = getattr(transformers, "ConvNextImageProcessorPil", None)
    kind = transformers.ConvNextImageProcessor if TORCHVISION or kind is None else kind
    return kind(
        size={"shortest_edge": size}, crop_pct=crop_pct, resample=Image.Resampling.BICUBIC,
        image_mean=list(mean), image_std=list(std),
    )  # fmt: skip


# Batches -----------------------------------------------------------------------------------------


class Images(Dataset[tuple[Tensor, int]]):
    """``dataset[(epoch, index)]`` = (transformed image, class index); augmentation seeded by
    ``(seed, epoch, index)``."""

    def __init__(self, source: ImageSource, transform: TrainTransform | EvalTransform, seed: int = 0) -> None:
        self.source, self.transform, self.seed = source, transform, seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: Key) -> tuple[Tensor, int]:
        epoch, index = key
        image, label = self.source.load(index)
        return self.transform(image, np.random.default_rng([self.seed, epoch, index])), label


def train_batches(
    size: int, global_batch: int, *, seed: int, epoch: int, rank: int, world_size: int
) -> list[list[Key]]:
    """This rank's batches of ``epoch``: a permutation from (seed, epoch), cut into global batches
    (the last incomplete one dropped), of which this rank takes slice ``rank``."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by {world_size} processes")
    if size < global_batch:
        raise DataError(f"{size} training images are fewer than one global batch of {global_batch}")
    order = np.random.default_rng([seed, epoch]).permutation(size)
    per_rank = global_batch // world_size
    return [
        [(epoch, int(i)) for i in order[start + rank * per_rank : start + (rank + 1) * per_rank]]
        for start in range(0, size - global_batch + 1, global_batch)
    ]


def eval_batches(size: int, batch: int, *, rank: int, world_size: int) -> list[list[Key]]:
    """Every index exactly once over all ranks (rank ``r`` takes ``r, r + world_size, ...``)."""
    mine = list(range(rank, size, world_size))
    return [[(0, i) for i in mine[start : start + batch]] for start in range(0, len(mine), batch)]


def loader(dataset: Images, batches: list[list[Key]], num_workers: int, pin_memory: bool) -> DataLoader[Any]:
    """Batches in the given order; ``batches[b:]`` resumes an epoch at batch ``b``."""
    return DataLoader(
        dataset,
        batch_sampler=batches,  # a list of lists of keys is a valid batch sampler
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if num_workers else None,
    )


def loader_throughput(
    dataset: Images, batches: list[list[Key]], num_workers: int, pin_memory: bool = False, warmup: int = 2
) -> float:
    """Images per second that one rank's loader delivers (decoding and augmentation, no model);
    the first ``warmup`` batches, which include starting the workers, are not timed."""
    images, start = 0, time.perf_counter()
    for index, (pixels, _) in enumerate(loader(dataset, batches, num_workers, pin_memory)):
        if index + 1 == warmup:
            images, start = 0, time.perf_counter()
        elif index >= warmup:
            images += len(pixels)
    return images / max(time.perf_counter() - start, 1e-9)
