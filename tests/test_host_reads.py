"""The recipes' training loops read tensors on the host (a host-device sync on a GPU) only at log,
evaluation and save steps, never per micro-batch (issue 23, item 5).

How: each recipe's ``main`` runs in this process, once for 1 optimizer step and once for 3, logging,
evaluating and saving only at the last step. Every tensor read made by the code of the recipe's
``train.py`` itself (``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``, ``.numpy()``,
``.cpu()``, formatting or printing a tensor) is counted by its caller's file. Both runs log, evaluate
and save once, so the counts must be equal; a read per step or micro-batch adds at least one per step
to the longer run. Counting at run time, by the caller's file, is robust where a static check of the
loop body is not: it sees reads through helpers and aliases, ignores the model's and libraries' own
internals, and depends on no line numbers.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="the recipes need pip install '.[recipes]'")
pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("tensorboard", reason="the recipes log to TensorBoard")

from recipes.imagenet import train as image_train
from recipes.translation import synthetic
from recipes.translation import train as text_train
from tests.test_accuracy import folder

READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__index__", "__bool__", "__format__")
READS_PRINTED = ("__repr__", "__str__")


def host_reads(main: Callable[[], None], source: str, monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Run ``main``; the tensor reads made by code of the file ``source``, counted per line."""
    counts: Counter[int] = Counter()

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename == source:
                counts[caller.f_lineno] += 1
            return original(self, *args, **kwargs)

        return read

    with monkeypatch.context() as patch:
        for name in READS + READS_PRINTED:
            patch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        main()
    return counts


def assert_no_read_per_step(
    main: Callable[[list[str]], None], source: str, settings: list[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``main(settings)`` for 1 and for 3 steps, logging, evaluating and saving at the last one only,
    makes the same tensor reads from ``source``."""

    def run(steps: int) -> Callable[[], None]:
        every = [f"train.{k}_every={steps}" for k in ("log", "eval", "save")]
        out = f"train.output_dir={tmp_path / f'run-{steps}'}"
        return lambda: main([*settings, f"train.max_steps={steps}", *every, out])

    one = host_reads(run(1), source, monkeypatch)
    three = host_reads(run(3), source, monkeypatch)
    assert sum(one.values()) > 0, "the counting saw no read at all (the log step reads the totals)"
    extra = {line: three[line] - one[line] for line in three if three[line] != one[line]}
    where = Path(source).name
    assert not extra, f"host reads per step in {where} (line: extra reads over 2 more steps): {extra}"


def test_translation_loop_reads_tensors_only_at_log_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=4)
    settings = [
        "--preset", "demo-synthetic-en-de", "--optimizer", "allreduce", f"data={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=200", "model.layers=1", "model.d_model=16",
        "model.ffn_dim=32", "model.heads=2", "train.global_tokens=512", "train.grad_accum=2",
        "train.mixed_precision=no",
    ]  # fmt: skip
    assert_no_read_per_step(text_train.main, text_train.__file__, settings, tmp_path, monkeypatch)


def test_image_loop_reads_tensors_only_at_log_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images = folder(tmp_path, ["cat", "dog", "fox"], per_class=2)
    (images / "val").rename(images / "train")  # 6 training images: 3 steps of 2
    folder(images, ["cat", "dog", "fox"], per_class=1)
    settings = [
        "--preset", "mnist-resnet-small-allreduce", f"data={images}",
        "data.image_size=16", "data.mean=[0.5, 0.5, 0.5]", "data.std=[0.25, 0.25, 0.25]",
        "model.embedding_size=8", "model.hidden_sizes=[8, 8, 8, 8]", "train.global_batch=2",
        "train.val_batch=3", "train.mixed_precision=no",
    ]  # fmt: skip
    assert_no_read_per_step(image_train.main, image_train.__file__, settings, tmp_path, monkeypatch)
