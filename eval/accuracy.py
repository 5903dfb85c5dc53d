"""Top-1 and top-5 accuracy of a Hugging Face image-classification checkpoint.

::

    python -m eval.accuracy runs/mnist-aer/step-465 --data runs/mnist-5k --split val
    python -m eval.accuracy microsoft/resnet-50 --data /data/imagenet --split val --output resnet50.json

``CHECKPOINT`` is any directory (or hub name) that ``AutoModelForImageClassification`` and
``AutoImageProcessor`` load: the recipes' ``step-N`` checkpoints hold the consensus model with its
image processor, and public checkpoints work the same way. The images are pre-processed by the
checkpoint's own processor, so the score does not depend on any recipe's transforms.

``--data`` is what the image recipe's ``data=`` takes, read by its reader
(``recipes.imagenet.data.open_split``): an image folder (``DIR/SPLIT/CLASS/IMAGE``), a local
``datasets`` directory (``save_to_disk``'s, or parquet files in the hub's layout,
``DIR/data/validation-00000-of-00014.parquet``) or a hub name (``ILSVRC/imagenet-1k --split
validation``); the last two with an ``image`` and a ``label`` (ClassLabel) column (``pip install
datasets``). Folder classes are matched to the model's labels by name
(``config.label2id``); when the names differ (ImageNet's WordNet-id folders against a public model's
readable labels) and the counts agree, class ``i`` of the sorted folder names is label ``i``, the
ImageNet convention, and the result says ``"label_mapping": "sorted-folder-order"``. An image that
cannot be decoded stops the evaluation with its path, as a wrong count would be reported otherwise.
The result is printed as JSON on stdout and written to ``--output``; exit codes: ``eval.contract``.
"""

from __future__ import annotations

if not __package__:  # run as a file, `eval` would not be a package
    raise SystemExit(
        f"{__file__} is a module of the eval package: run python -m eval.accuracy from the repository root"
    )

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from eval.contract import CheckpointError, DataError, MismatchError, main
from recipes.imagenet.data import DataError as ImageError
from recipes.imagenet.data import ImageSource, open_split

__all__ = ["evaluate", "label_mapping"]

logger = logging.getLogger(__name__)


class _Decoded(Dataset[tuple[Image.Image, int]]):
    """The first ``count`` items of a source as (RGB image, class index): decoded in the loader's workers."""

    def __init__(self, source: ImageSource, count: int) -> None:
        self.source, self.count = source, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return self.source.load(index)


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
    raise MismatchError(
        f"the data has {len(classes)} classes ({', '.join(classes[:5])}, ...) that are not among the model's "
        f"{model_config.num_labels} labels by name, and their number differs: no way to match them"
    )


def evaluate(
    checkpoint: str,
    data: str,
    split: str,
    *,
    batch_size: int = 64,
    num_workers: int = 0,
    limit: int = 0,
    device: str = "auto",
) -> dict[str, Any]:
    """Top-1 and top-5 of ``checkpoint`` on ``split`` of ``data`` (the first ``limit`` images if > 0).

    Raises :class:`eval.contract.DataError`, ``CheckpointError`` or ``MismatchError``.
    """
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    started = time.perf_counter()
    try:
        source = open_split(data, split)
    except ImageError as error:
        raise DataError(str(error)) from None
    if Path(checkpoint).exists() and not Path(checkpoint).is_dir():
        raise CheckpointError(f"{checkpoint} is a file: give a checkpoint directory (or a hub name)")
    try:
        processor = AutoImageProcessor.from_pretrained(checkpoint)  # type: ignore[no-untyped-call]
        model = AutoModelForImageClassification.from_pretrained(checkpoint)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{checkpoint}: not an image-classification checkpoint that from_pretrained loads ({error})"
        ) from None
    run_on = torch.device(device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(run_on).eval()
    label_ids, mapping = label_mapping(source.classes, model.config)
    to_label = torch.tensor(label_ids)

    def collate(items: list[tuple[Image.Image, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = processor(images=[image for image, _ in items], return_tensors="pt")["pixel_values"]
        return pixels, to_label[torch.tensor([label for _, label in items])]

    count = len(source) if not limit else min(limit, len(source))
    images = _Decoded(source, count)
    loader = DataLoader(images, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)
    correct1 = correct5 = seen = 0
    k = min(5, model.config.num_labels)
    try:
        with torch.no_grad():
            for pixels, labels in loader:
                scores = model(pixel_values=pixels.to(run_on)).logits.float().cpu()  # (B, num_labels)
                top = scores.topk(k, dim=1).indices
                correct1 += int((top[:, 0] == labels).sum())
                correct5 += int((top == labels[:, None]).any(dim=1).sum())
                seen += len(labels)
    except ImageError as error:
        raise DataError(str(error)) from None
    if seen == 0:
        raise DataError(f"{data} split {split}: no images to score")
    return {
        "checkpoint": checkpoint,
        "data": data,
        "split": split,
        "images": seen,
        "classes": len(source.classes),
        "top1": correct1 / seen,
        "top5": correct5 / seen,
        "top5_k": k,
        "label_mapping": mapping,
        "processor": type(processor).__name__,
        "model": type(model).__name__,
        "seconds": round(time.perf_counter() - started, 3),
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eval.accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="checkpoint directory or hub name (model + image processor)")
    parser.add_argument("--data", required=True, help="DIR/SPLIT/CLASS/IMAGE, datasets dir or hub name")
    parser.add_argument("--split", default="val", help="split folder or datasets split (default: val)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers decoding images")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N images (0 = all)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--output", help="also write the JSON result to this file")
    return parser


def _evaluate(args: argparse.Namespace) -> dict[str, Any]:
    return evaluate(
        args.checkpoint, args.data, args.split,
        batch_size=args.batch_size, num_workers=args.num_workers, limit=args.limit, device=args.device,
    )  # fmt: skip


def run() -> None:
    """The command line: ``python -m eval.accuracy``, or ``decentadam-accuracy`` once installed."""
    main(parser(), _evaluate)


if __name__ == "__main__":
    run()
