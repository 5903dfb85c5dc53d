"""A fresh virtual environment outside the repository (issue 46): ``pip install '<clone>[recipes]'``
at the versions of constraints.txt, then the installed commands from another directory. Slow (a few
minutes: the recipes' dependencies, torch included, come from the package index or pip's cache), so
``make test-slow`` (CI) runs it; tests/test_commands.py checks the same commands in this environment."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

from tests.test_commands import ROOT, package_sources

COMMANDS = {  # command: what its --help must say
    "decentadam-train": "translation: presets demo-synthetic-en-de, multi30k-en-de",
    "decentadam-bleu": "--average-last",
    "decentadam-accuracy": "--data",
    "decentadam-plot": "metrics.jsonl",
    "decentadam-export": "--push-to-hub OWNER/NAME",
}


def run(command: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=environment)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_fresh_venv_installs_the_clone_with_its_recipes_and_the_commands_run_elsewhere(
    tmp_path: Path,
) -> None:
    source = package_sources(tmp_path / "clone")
    environment = tmp_path / "env"
    venv.create(environment, with_pip=True)
    python = environment / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt")]
    for what in ("torch==2.13.0", f"{source}[recipes]"):  # torch first, as the Makefile does
        done = run([*pip, what], tmp_path, timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run(
        [str(python), "-c", "import recipes, eval, decentadam; print(recipes.__file__)"], elsewhere, 120
    )
    assert where.returncode == 0 and where.stdout.startswith(str(environment)), where.stderr
    for command, says in COMMANDS.items():
        done = run([str(environment / "bin" / command), "--help"], elsewhere, 300)
        assert done.returncode == 0 and says in done.stdout, (
            command,
            done.stdout[-500:],
            done.stderr[-2000:],
        )
