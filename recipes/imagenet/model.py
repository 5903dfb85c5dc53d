"""The classifier: a transformers ResNet, or any AutoModelForImageClassification, with random weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# `resnet50` is ResNetConfig's default (bottleneck blocks, depths 3-4-6-3, 25.6M parameters with
# 1000 classes); `resnet-small` takes its sizes from the [model] section.
BUILT_IN = ("resnet50", "resnet-small")


def build_model(
    name: str,
    classes: list[str],
    *,
    layer_type: str = "basic",
    embedding_size: int = 32,
    hidden_sizes: tuple[int, ...] = (32, 64, 128, 256),
    depths: tuple[int, ...] = (1, 1, 1, 1),
) -> nn.Module:
    """A randomly initialised classifier for ``classes`` (saved with them as ``id2label``)."""
    from transformers import AutoConfig, AutoModelForImageClassification, ResNetConfig

    labels: dict[str, Any] = {
        "num_labels": len(classes),
        "id2label": dict(enumerate(classes)),
        "label2id": {c: i for i, c in enumerate(classes)},
    }
    if name == "resnet50":
        config = ResNetConfig(**labels)
    elif name == "resnet-small":
        config = ResNetConfig(
            layer_type=layer_type,
            embedding_size=embedding_size,
            hidden_sizes=list(hidden_sizes),
            depths=list(depths),
            **labels,
        )
    else:
        config = AutoConfig.from_pretrained(name, **labels)
    return AutoModelForImageClassification.from_config(config)  # type: ignore[no-any-return, no-untyped-call]


def logits(model: nn.Module, pixels: Tensor) -> Tensor:
    """(B, classes) logits of (B, 3, H, W) pixels."""
    return model(pixel_values=pixels).logits  # type: ignore[no-any-return]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def to_channels_last(model: nn.Module, device: torch.device, enabled: bool) -> nn.Module:
    """Channels-last memory format on a GPU (convolutions run in NHWC kernels); CPUs keep NCHW."""
    if enabled and device.type == "cuda":
        return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload, no-any-return]
    return model
