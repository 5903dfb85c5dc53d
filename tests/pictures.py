"""Checks of a saved plot: read back as an image, of the expected size, drawn on."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def assert_drawn(path: Path, size: tuple[int, int]) -> None:
    """``path`` is an image of ``size`` pixels (figsize x dpi) with more than a background, a frame
    and a few labels in it: anti-aliased curves, bars and text leave far more than 20 colours."""
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == size, (image.format, image.size)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16) or []
    assert len(colours) > 20, f"{path.name}: {len(colours)} colours, nearly blank"
