"""Write a folder of ImageNet-like JPEGs: what the image recipe's loader reads, at ImageNet's sizes.

Run from the repository root::

    python -m benchmarks.imagenet_jpegs runs/imagenet-jpegs        # 2,000 train + 200 val, 100 classes
    python -m benchmarks.imagenet_jpegs /tmp/jpegs --images 12 --classes 3 --val-per-class 1

The layout is the recipe's image folder (``recipes.imagenet.data.ImageFolder``, ImageNet's own):
``ROOT/train/CLASS/CLASS_I.JPEG`` and ``ROOT/val/CLASS/CLASS_I.JPEG``, class folders named like
WordNet ids (``n00000000``, ``n00000001``, ...), the training images dealt to the classes in turn.
It is made for timing the loader (``benchmarks.imagenet_loader``), not for learning: the classes
carry no signal.

What makes decoding cost what a photo costs is the size of the image and of its JPEG data:

- sizes: most of ImageNet's training images are 500 x 375 or 375 x 500 (the long side 500); here 45%
  are 500 x 375, 15% 375 x 500, 8% 500 x 333, 4% 333 x 500, 25% smaller (long side 150-500, aspect
  0.6-1) and 3% larger (long side 600-1,200);
- content: a colour texture with a natural image's falling spectrum (noise summed over octaves, each
  ``decay`` times weaker than the coarser one, with correlated channels), a vertical colour gradient
  and a few ellipses of other colours under the same texture, saved at ``--quality`` 90. The
  defaults give about 110 KB per 500 x 375 file, as ImageNet's JPEGs average; the summary printed
  (and :func:`write`'s result) says what this run wrote.

Each image depends only on ``(seed, index)``, so a folder is reproducible.
"""

from __future__ import annotations

if not __package__:  # run as a file: the `benchmarks` package would not be importable
    raise SystemExit(
        f"{__file__} is a module of the benchmarks package: run python -m benchmarks.imagenet_jpegs "
        "from the repository root"
    )

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

__all__ = ["image_sizes", "photo", "write"]

CHANNEL_MIX = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.45, 0.0], [0.6, 0.2, 0.45]])
"""Mixes three independent textures into correlated R, G, B, as a photo's channels are."""


def image_sizes(count: int, rng: np.random.Generator) -> np.ndarray:
    """(width, height) of ``count`` images, drawn as the module's docstring says: an int array (count, 2)."""
    kind = rng.choice(6, size=count, p=[0.45, 0.15, 0.08, 0.04, 0.25, 0.03])
    fixed = np.array([[500, 375], [375, 500], [500, 333], [333, 500]])
    sizes = fixed[np.minimum(kind, 3)]
    long_side = np.where(kind == 4, rng.integers(150, 500, count), rng.integers(600, 1201, count))
    short_side = np.round(long_side * rng.uniform(0.6, 1.0, count)).astype(int)
    landscape = rng.random(count) < 0.7
    drawn = np.where(
        landscape[:, None], np.stack([long_side, short_side], 1), np.stack([short_side, long_side], 1)
    )
    return np.where((kind >= 4)[:, None], drawn, sizes)


def photo(width: int, height: int, seed: int, decay: float = 0.9, contrast: float = 65.0) -> Image.Image:
    """An RGB image of ``width`` x ``height`` whose JPEG costs about what a photo's does (see the module)."""
    rng = np.random.default_rng(seed)
    noise = torch.Generator().manual_seed(seed)
    levels = math.ceil(math.log2(max(width, height) / 3))
    texture = torch.randn(1, 3, height // 2**levels + 2, width // 2**levels + 2, generator=noise)
    for level in range(1, levels + 1):  # each octave twice as fine and `decay` times weaker
        texture = F.interpolate(texture, scale_factor=2.0, mode="bilinear", align_corners=False)
        texture += decay**level * torch.randn(texture.shape, generator=noise)
    texture = texture[0, :, :height, :width]  # (3, H, W)
    texture = torch.einsum("ij,jhw->ihw", CHANNEL_MIX, texture / texture.std())

    shapes = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(60, 190, 3)))
    draw = ImageDraw.Draw(shapes)
    for _ in range(int(rng.integers(2, 6))):
        left, top = int(rng.integers(0, width)), int(rng.integers(0, height))
        right = left + int(rng.integers(20, max(21, width // 2)))
        bottom = top + int(rng.integers(20, max(21, height // 2)))
        draw.ellipse((left, top, right, bottom), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    base = torch.from_numpy(np.asarray(shapes, dtype=np.float32)).permute(2, 0, 1)  # (3, H, W)
    gradient = torch.from_numpy(rng.uniform(-50, 50, 3).astype(np.float32))[:, None, None]
    gradient = gradient * torch.linspace(-1.0, 1.0, height)[:, None]  # (3, H, 1)
    pixels = (base + gradient + contrast * texture).clamp(0, 255).to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())  # (H, W, 3)


def write(
    root: str | Path,
    images: int = 2000,
    classes: int = 100,
    val_per_class: int = 2,
    *,
    seed: int = 0,
    quality: int = 90,
) -> dict[str, Any]:
    """Write ``images`` training and ``classes * val_per_class`` validation JPEGs under ``root``;
    returns what was written (counts, mean file size and mean width and height of each split)."""
    if images < classes or classes < 1 or val_per_class < 1:
        raise ValueError(
            f"need classes >= 1, images >= classes and val_per_class >= 1; got images={images}, "
            f"classes={classes}, val_per_class={val_per_class}"
        )
    names = [f"n{c:08d}" for c in range(classes)]
    rng = np.random.default_rng(seed)
    summary: dict[str, Any] = {"root": str(root), "classes": classes, "quality": quality, "seed": seed}
    start = 0
    for split, count in (("train", images), ("val", classes * val_per_class)):
        sizes = image_sizes(count, rng)
        written = 0
        for index, (width, height) in enumerate(sizes):
            name = names[index % classes]
            folder = Path(root) / split / name
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{name}_{index // classes}.JPEG"
            photo(int(width), int(height), seed=seed * 1_000_003 + start + index).save(path, quality=quality)
            written += path.stat().st_size
        start += count
        summary[split] = {
            "images": count,
            "mean_kb": round(written / count / 1000, 1),
            "mean_width": round(float(sizes[:, 0].mean()), 1),
            "mean_height": round(float(sizes[:, 1].mean()), 1),
        }
    return summary


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.imagenet_jpegs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("root", help="folder to write (train/ and val/ are created in it)")
    parser.add_argument("--images", type=int, default=2000, help="training images (default 2000)")
    parser.add_argument("--classes", type=int, default=100, help="class folders (default 100)")
    parser.add_argument(
        "--val-per-class", type=int, default=2, help="validation images per class (default 2)"
    )
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if (Path(args.root) / "train").exists():
        raise SystemExit(f"error: {args.root}/train exists: give a new folder")
    summary = write(
        args.root, args.images, args.classes, args.val_per_class, seed=args.seed, quality=args.quality
    )
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
