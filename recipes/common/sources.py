"""One ``data`` argument, three kinds of source, for every recipe and ``eval`` script.

:func:`source_kind` tells them apart:

``files``
    an existing directory in the recipe's own plain-file layout (``{split}.{lang}[.gz]`` for
    translation, ``SPLIT/CLASS/IMAGE`` for images), read by the recipe's own reader;
``saved``
    an existing directory that ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote (it
    holds ``dataset_dict.json``, ``state.json`` or ``dataset_info.json``): ``datasets.load_from_disk``;
``parquet``
    an existing directory of parquet files in the hub's layout, the split named by each file
    (``DIR/de-en/train-00000-of-00003.parquet``, ``DIR/data/validation-00000-of-00014.parquet``) or
    by its folder (``DIR/de-en/test/0000.parquet``); the first folder under ``DIR`` is the config
    when there are several (WMT14's language pairs): ``load_dataset("parquet", data_files=...)``;
``hub``
    a path that does not exist and looks like ``owner/name`` (``wmt/wmt14``, ``ILSVRC/imagenet-1k``):
    ``datasets.load_dataset(name, config, split=split)``, which downloads it (or reads its cache).

:func:`load_split` returns a split of the last three as a ``datasets.Dataset`` (``datasets`` is
imported only then); the recipes read their columns from it. A bad input raises :class:`DataError`
naming the dataset and what is expected: a path of none of the kinds, an unknown split or config
(with the ones present), a missing column (with the columns present).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "SAVED_MARKERS",
    "DataError",
    "Kind",
    "load_split",
    "parquet_layout",
    "require_columns",
    "source_kind",
]

Kind = Literal["files", "saved", "parquet", "hub"]
SAVED_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
"""Files that ``save_to_disk`` writes at the top of its directory (a DatasetDict, or one Dataset)."""
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class DataError(ValueError):
    """Input that cannot be trained on or scored; the message names the dataset and what is expected."""


def kinds(files: str, hub: str) -> str:
    """The three accepted kinds, for error messages: ``files`` and ``hub`` are the recipe's examples."""
    return (
        f"expected a directory of {files}, a local `datasets` directory (written by save_to_disk, or "
        f"parquet files in the hub's layout such as DIR/data/train-00000-of-00001.parquet) or a hub "
        f"name owner/name such as {hub}"
    )


def source_kind(path: str, *, files: str, hub: str) -> Kind:
    """Which kind of source ``path`` is (see the module's docstring); ``files`` and ``hub`` describe
    the recipe's plain-file layout and a hub example in the error for a path of no kind."""
    root = Path(path)
    if root.is_dir():
        if any((root / marker).is_file() for marker in SAVED_MARKERS):
            return "saved"
        if next(root.rglob("*.parquet"), None) is not None:
            return "parquet"
        return "files"
    if root.exists():
        raise DataError(f"{path} is a file, not a dataset: {kinds(files, hub)}")
    if HUB_NAME.fullmatch(path) and not path.startswith("."):
        return "hub"
    raise DataError(f"{path}: no such directory, and not a hub name (owner/name): {kinds(files, hub)}")


def parquet_layout(root: str | Path) -> dict[str, dict[str, list[str]]]:
    """``{config: {split: [files]}}`` of a directory of parquet files in the hub's layout.

    The split of a file is the part of its name before the first ``-`` (split names have none:
    ``train-00000-of-00003.parquet`` is in ``train``), or its folder's name when that part is a
    number (``test/0000.parquet``). The config is the first folder below ``root`` ("" for files
    directly in it).
    """
    layout: dict[str, dict[str, list[str]]] = {}
    for file in sorted(Path(root).rglob("*.parquet")):
        relative = file.relative_to(root)
        split = file.stem.split("-")[0]
        if split.isdigit():
            split = file.parent.name
        config = relative.parts[0] if len(relative.parts) > 1 else ""
        if config == split:  # DIR/train/0000.parquet: no config level
            config = ""
        layout.setdefault(config, {}).setdefault(split, []).append(str(file))
    return layout


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a hub name or a local `datasets` directory needs `datasets`: "
            "pip install 'decentadam[recipes]' (or pip install datasets)"
        ) from None
    return datasets


def _unknown_split(name: str, split: str, present: list[str] | tuple[str, ...]) -> DataError:
    return DataError(f"{name}: no split {split!r}; it has {', '.join(sorted(present)) or 'none'}")


def load_split(path: str, kind: Kind, split: str, config: str | None = None) -> Any:
    """Split ``split`` of a ``saved``, ``parquet`` or ``hub`` source as a ``datasets.Dataset``.

    ``config`` picks a config of a parquet directory (its first folder level) or of a hub dataset;
    None takes the only one there is (a parquet directory with several configs raises).
    """
    datasets = _datasets()
    if kind == "saved":
        try:
            loaded = datasets.load_from_disk(path)
        except (OSError, ValueError) as error:
            raise DataError(f"{path}: cannot load it with datasets.load_from_disk ({error})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise _unknown_split(path, split, list(loaded))
            return loaded[split]
        if loaded.split is None or str(loaded.split) != split:
            raise DataError(
                f"{path}: holds one Dataset (split {loaded.split or 'unnamed'}), not split {split!r}: save a "
                f"DatasetDict with one entry per split, DatasetDict({{{split!r}: ...}}).save_to_disk(DIR)"
            )
        return loaded
    if kind == "parquet":
        layout = parquet_layout(path)
        if config is None:
            if len(layout) > 1:
                raise DataError(
                    f"{path}: holds the parquet files of several configs ({', '.join(sorted(layout))}): "
                    "give the directory of one of them"
                )
            config = next(iter(layout))
        if config not in layout:
            raise DataError(f"{path}: no config {config!r}; it has {', '.join(sorted(layout))}")
        splits = layout[config]
        name = str(Path(path) / config) if config else path
        if split not in splits:
            raise _unknown_split(name, split, list(splits))
        return datasets.load_dataset("parquet", data_files={split: splits[split]}, split=split)
    if kind == "hub":
        try:
            return datasets.load_dataset(path, config, split=split)
        except Exception as error:  # the hub's errors: network, access, unknown config or split
            where = f"config {config}, split {split}" if config else f"split {split}"
            raise DataError(
                f"{path} ({where}): not a local directory, so read as a hub name, and loading it failed "
                f"({type(error).__name__}: {error})"
            ) from None
    raise ValueError(f"load_split reads saved, parquet or hub sources, not {kind!r}")


def require_columns(dataset: Any, name: str, split: str, columns: dict[str, str]) -> None:
    """Raise unless ``dataset`` has every column of ``columns`` (name: what it should hold)."""
    present = list(dataset.column_names)
    for column, expected in columns.items():
        if column not in present:
            raise DataError(
                f"{name} (split {split}): no column {column!r} (expected {expected}); it has "
                f"{', '.join(present) or 'no columns'}"
            )
