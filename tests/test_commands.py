"""The installed commands (issue 46, items 1, 3 and 4): ``pip install`` puts ``decentadam-train``,
``decentadam-bleu``, ``decentadam-accuracy``, ``decentadam-plot`` and ``decentadam-export`` on the
path, with the recipes, their presets and the evaluations packaged, so that they and the ``python
-m`` forms work from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("setuptools", reason="installing the package needs setuptools")
pytest.importorskip("accelerate", reason="the recipes need pip install '.[recipes]'")
pytest.importorskip("sacrebleu", reason="eval.bleu needs pip install '.[recipes]'")

from recipes.commands import recipe_of

ROOT = Path(__file__).resolve().parents[1]


def package_sources(source: Path) -> Path:
    """A copy of what ``pip install`` builds the package from (no results, no caches), so that a
    build leaves nothing in the repository; ``source``, created."""
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "results")
    for package in ("decentadam", "recipes", "eval"):
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    return source


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install --target`` of a copy of the package's sources (no dependencies: this
    environment's serve), so that the build leaves nothing in the repository."""
    base = tmp_path_factory.mktemp("install")
    source = package_sources(base / "source")
    site = base / "site"
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
        "--no-index", "--target", str(site), str(source),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return site


def elsewhere(site: Path, cwd: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` run in ``cwd`` (not the repository) with the installed packages on the path only."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(list(command), capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def test_the_commands_work_from_another_directory(installed: Path, tmp_path: Path) -> None:
    where = elsewhere(
        installed, tmp_path, sys.executable, "-c", "import recipes, eval; print(recipes.__file__)"
    )
    assert where.stdout.startswith(str(installed)), where.stderr  # not the repository's
    bin_dir = installed / "bin"

    done = elsewhere(installed, tmp_path, str(bin_dir / "decentadam-train"), "--help")
    assert done.returncode == 0 and "translation: presets demo-synthetic-en-de, multi30k-en-de" in done.stdout
    done = elsewhere(installed, tmp_path, str(bin_dir / "decentadam-train"), "translation", "--help")
    assert done.returncode == 0 and "--log-format" in done.stdout
    for command in ("decentadam-bleu", "decentadam-accuracy"):
        done = elsewhere(installed, tmp_path, str(bin_dir / command), "--help")
        assert done.returncode == 0 and "--data" in done.stdout, done.stderr
    done = elsewhere(installed, tmp_path, str(bin_dir / "decentadam-plot"), "--help")
    assert done.returncode == 0 and "metrics.jsonl" in done.stdout, done.stderr
    done = elsewhere(installed, tmp_path, str(bin_dir / "decentadam-export"), "--help")
    assert done.returncode == 0 and "--push-to-hub OWNER/NAME" in done.stdout, done.stderr

    # the preset found by name (packaged with the recipe), then refused without data: one line, exit 2
    done = elsewhere(installed, tmp_path, str(bin_dir / "decentadam-train"), "--preset", "multi30k-en-de")
    assert done.returncode == 2 and done.stderr == (
        "error: data.path is empty: give the data directory (data=DIR) or a hub name (wmt/wmt14)\n"
    )
    done = elsewhere(installed, tmp_path, sys.executable, "-m", "recipes.imagenet.train", "--help")
    assert done.returncode == 0 and "mnist-resnet-small-accumadam" in done.stdout
    done = elsewhere(installed, tmp_path, sys.executable, "-m", "eval.bleu", "--help")
    assert done.returncode == 0 and "--compare" in done.stdout


def test_the_recipe_comes_from_the_first_argument_or_the_preset() -> None:
    assert recipe_of(["imagenet", "--preset", "x.toml"]) == ("imagenet", ["--preset", "x.toml"])
    assert recipe_of(["--preset", "multi30k-en-de", "data=D"]) == (
        "translation",
        ["--preset", "multi30k-en-de", "data=D"],
    )
    assert recipe_of(["--preset=mnist-resnet-small-allreduce"])[0] == "imagenet"
    with pytest.raises(
        ValueError, match=r"--preset my\.toml is not a preset of a recipe: name the recipe first"
    ):
        recipe_of(["--preset", "my.toml"])
    with pytest.raises(ValueError, match="no recipe and no --preset given"):
        recipe_of(["data=D"])
