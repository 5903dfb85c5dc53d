"""eval/accuracy.py on a plain Hugging Face checkpoint (not one of ours): label matching, top-k, errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers", reason="eval/accuracy.py needs transformers")

ROOT = Path(__file__).resolve().parent.parent


def accuracy_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("eval_accuracy", ROOT / "eval" / "accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def public_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ResNet saved by plain save_pretrained, with generic labels LABEL_0..2 and a ConvNext processor."""
    from transformers import ConvNextImageProcessor, ResNetConfig, ResNetForImageClassification

    out = tmp_path_factory.mktemp("public")
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], num_labels=3)
    ResNetForImageClassification(config).save_pretrained(out)
    ConvNextImageProcessor(size={"shortest_edge": 16}, crop_pct=1.0).save_pretrained(out)
    return out


def folder(root: Path, classes: list[str], per_class: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for name in classes:
        (root / "val" / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "val" / name / f"{i}.png")
    return root


def test_public_checkpoint_with_other_label_names_is_scored_in_sorted_folder_order(
    public_checkpoint: Path, tmp_path: Path
) -> None:
    data = folder(tmp_path, ["n02", "n01", "n03"])
    result = accuracy_module().evaluate(str(public_checkpoint), str(data), "val", batch_size=4)
    assert (
        result["images"] == 9 and result["classes"] == 3 and result["label_mapping"] == "sorted-folder-order"
    )
    assert result["top5_k"] == 3 and result["top5"] == 1.0  # 3 labels: the top 3 hold every answer
    assert 0.0 <= result["top1"] <= 1.0


def test_label_names_are_matched_by_name(public_checkpoint: Path, tmp_path: Path) -> None:
    module = accuracy_module()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(public_checkpoint)
    assert module.label_mapping(["LABEL_2", "LABEL_0"], config) == ([2, 0], "names")
    with pytest.raises(module.EvalError, match="no way to match them"):
        module.label_mapping(["a", "b"], config)


def test_command_line_writes_json_and_names_a_missing_split(public_checkpoint: Path, tmp_path: Path) -> None:
    data = folder(tmp_path / "data", ["a", "b", "c"], per_class=1)
    script = [sys.executable, str(ROOT / "eval" / "accuracy.py"), str(public_checkpoint), "--data", str(data)]
    done = subprocess.run([*script, "--output", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out.json").read_text())["images"] == 3
    missing = subprocess.run([*script, "--split", "test"], capture_output=True, text=True)
    assert missing.returncode == 2 and f"{data / 'test'}: no such folder" in missing.stderr
