"""eval.accuracy on a plain Hugging Face checkpoint (not one of ours): label matching, top-k, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers", reason="eval.accuracy needs transformers")

from eval import accuracy, contract
from recipes.common.launch import environment


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
    result = accuracy.evaluate(str(public_checkpoint), str(data), "val", batch_size=4)
    assert (
        result["images"] == 9 and result["classes"] == 3 and result["label_mapping"] == "sorted-folder-order"
    )
    assert result["top5_k"] == 3 and result["top5"] == 1.0  # 3 labels: the top 3 hold every answer
    assert 0.0 <= result["top1"] <= 1.0


def test_label_names_are_matched_by_name(public_checkpoint: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(public_checkpoint)
    assert accuracy.label_mapping(["LABEL_2", "LABEL_0"], config) == ([2, 0], "names")
    with pytest.raises(contract.MismatchError, match="no way to match them"):
        accuracy.label_mapping(["a", "b"], config)


def test_command_line_prints_json_writes_output_and_exits_with_the_error_kind(
    public_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = folder(tmp_path / "data", ["a", "b", "c"], per_class=1)
    # the entry point, once, in a process of its own: the JSON on stdout and in --output, exit code 0
    command = [sys.executable, "-m", "eval.accuracy", str(public_checkpoint), "--data", str(data)]
    command += ["--output", str(tmp_path / "out.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads((tmp_path / "out.json").read_text())
    assert json.loads(done.stdout)["images"] == 3

    def command_line(*args: str) -> tuple[int | str | None, str, str]:
        """The same command line in this process (what its ``__main__`` runs): exit code, stdout, stderr."""
        with pytest.raises(SystemExit) as exit_info:
            contract.main(accuracy.parser(), accuracy._evaluate, list(args))
        out, err = capsys.readouterr()
        return exit_info.value.code, out, err

    code, out, err = command_line(str(public_checkpoint), "--data", str(data), "--split", "test")
    assert code == 3 and f"error: {data / 'test'}: no such folder" in err
    assert out == ""
    code, _, err = command_line(str(data), "--data", str(data))
    assert code == 4 and "not an image-classification checkpoint" in err
    ten = folder(tmp_path / "ten", [f"c{i}" for i in range(10)], per_class=1)  # 10 classes, 3 labels
    code, _, err = command_line(str(public_checkpoint), "--data", str(ten))
    assert code == 5 and "no way to match them" in err
