"""Top-1 and top-5 accuracy of a Hugging Face image-classification checkpoint, as JSON.

::

    python eval/accuracy.py runs/mnist-aer/step-465 --data runs/mnist-5k --split val
    python eval/accuracy.py microsoft/resnet-50 --data /data/imagenet --split val --output resnet50.json

``CHECKPOINT`` is any directory (or hub name) that ``AutoModelForImageClassification`` and
``AutoImageProcessor`` load: the recipes' ``step-N`` checkpoints hold the consensus model with its
image processor, and public checkpoints work the same way. The images are pre-processed by the
checkpoint's own processor, so the score does not depend on any recipe's code.

``--data`` is an image folder (``DIR/SPLIT/CLASS/IMAGE``) or a hub data set with ``image`` and
``label`` columns (``pip install datasets``). Folder classes are matched to the model's labels by
name (``config.label2id``); when the names differ (ImageNet's WordNet-id folders against a public
model's readable labels) and the counts agree, class ``i`` of the sorted folder names is label ``i``,
the ImageNet convention, and the JSON says ``"label_mapping": "sorted-folder-order"``. An image that
cannot be decoded stops the evaluation with its path, as a wrong count would be reported otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger("eval.accuracy")

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)


class EvalError(ValueError):
    """Input that cannot be scored; the message names the path."""


class FolderSplit(Dataset[tuple[Image.Image, int]]):
    """``root/CLASS/IMAGE`` -> (RGB image, index of CLASS among the sorted class names)."""

    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise EvalError(f"{root}: no such folder (expected one sub-folder of images per class)")
        class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not class_dirs:
            raise EvalError(f"{root}: no class folders in it")
        self.classes = [p.name for p in class_dirs]
        self.samples: list[tuple[Path, int]] = []
        for label, folder in enumerate(class_dirs):
            images = sorted(
                p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
            )
            if not images:
                raise EvalError(f"{folder}: class folder without images")
            self.samples.extend((p, label) for p in images)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                return image.convert("RGB"), label
        except (OSError, SyntaxError, ValueError) as error:
            raise EvalError(f"{path}: cannot read this image ({type(error).__name__}: {error})") from None


class HubSplit(Dataset[tuple[Image.Image, int]]):
    """A split of a hub data set with an ``image`` column and a ``label`` ClassLabel column."""

    def __init__(self, name: str, split: str) -> None:
        try:
            import datasets
        except ImportError:
            raise EvalError(
                f"{name}: not a folder, and reading it from the hub needs `pip install datasets`"
            ) from None
        self.rows = datasets.load_dataset(name, split=split)
        self.classes = list(self.rows.features["label"].names)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        row = self.rows[index]
        return row["image"].convert("RGB"), int(row["label"])


def label_mapping(classes: list[str], model_config: Any) -> tuple[list[int], str]:
    """The model's label id of each data class, and how it was found."""
    label2id = {str(k): int(v) for k, v in (getattr(model_config, "label2id", None) or {}).items()}
    if all(c in label2id for c in classes):
        return [label2id[c] for c in classes], "names"
    if len(classes) == model_config.num_labels:
        logger.warning(
            "the data's class names are not the model's labels; taking class i of the sorted names as label i"
        )
        return list(range(len(classes))), "sorted-folder-order"
    raise EvalError(
        f"the data has {len(classes)} classes ({', '.join(classes[:5])}, ...) that are not among the model's "
        f"{model_config.num_labels} labels by name, and their number differs: no way to match them"
    )


def evaluate(
    checkpoint: str,
    data: str,
    split: str,
    *,
    batch_size: int = 64,
    workers: int = 0,
    limit: int = 0,
    device: str = "auto",
) -> dict[str, Any]:
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    started = time.perf_counter()
    root = Path(data)
    dataset: FolderSplit | HubSplit = FolderSplit(root / split) if root.is_dir() else HubSplit(data, split)
    processor = AutoImageProcessor.from_pretrained(checkpoint)  # type: ignore[no-untyped-call]
    model = AutoModelForImageClassification.from_pretrained(checkpoint)
    run_on = torch.device(device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(run_on).eval()
    label_ids, mapping = label_mapping(dataset.classes, model.config)
    to_label = torch.tensor(label_ids)
    indices = list(range(len(dataset) if not limit else min(limit, len(dataset))))

    def collate(items: list[tuple[Image.Image, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = processor(images=[image for image, _ in items], return_tensors="pt")["pixel_values"]
        return pixels, to_label[torch.tensor([label for _, label in items])]

    loader = DataLoader(
        torch.utils.data.Subset(dataset, indices),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate,
    )
    correct1 = correct5 = seen = 0
    k = min(5, model.config.num_labels)
    with torch.no_grad():
        for pixels, labels in loader:
            scores = model(pixel_values=pixels.to(run_on)).logits.float().cpu()  # (B, num_labels)
            top = scores.topk(k, dim=1).indices
            correct1 += int((top[:, 0] == labels).sum())
            correct5 += int((top == labels[:, None]).any(dim=1).sum())
            seen += len(labels)
    if seen == 0:
        raise EvalError(f"{data} split {split}: no images to score")
    return {
        "checkpoint": checkpoint,
        "data": data,
        "split": split,
        "images": seen,
        "classes": len(dataset.classes),
        "top1": correct1 / seen,
        "top5": correct5 / seen,
        "top5_k": k,
        "label_mapping": mapping,
        "processor": type(processor).__name__,
        "model": type(model).__name__,
        "seconds": round(time.perf_counter() - started, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="checkpoint directory or hub name (model + image processor)")
    parser.add_argument("--data", required=True, help="image folder (DIR/SPLIT/CLASS/IMAGE) or hub data set")
    parser.add_argument("--split", default="val", help="split folder or hub split (default: val)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers decoding images")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N images (0 = all)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        result = evaluate(
            args.checkpoint, args.data, args.split,
            batch_size=args.batch_size, workers=args.workers, limit=args.limit, device=args.device,
        )  # fmt: skip
    except (EvalError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    text = json.dumps(result, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
