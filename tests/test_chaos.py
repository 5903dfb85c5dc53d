"""Restarts without a person: a recipe run under ``torchrun --max-restarts`` with ``--resume auto``
is killed and comes back (``benchmarks.chaos``), and the examples' ``--resume auto`` decisions.

The default suite runs one fault (a rank killed while a checkpoint is half written) on 2 ranks;
``pytest -m slow`` runs the full chaos benchmark (4 ranks, kills and stalls), whose numbers
docs/testing.md reports.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("accelerate", reason="the translation recipe needs pip install '.[recipes]'")
pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")

from benchmarks import chaos  # noqa: E402
from recipes.common.launch import environment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_a_rank_killed_while_saving_is_restarted_and_the_run_ends_bitwise_equal(tmp_path: Path) -> None:
    args = chaos.parse_args(
        ["--processes", "2", "--steps", "6", "--save-every", "2", "--faults", "kill-in-save",
         "--timeout-s", "10", "--save-delay-s", "1", "--deadline-s", "240", "--seed", "1"]
    )  # fmt: skip
    result = chaos.run(args, tmp_path)
    assert result["passed"], result["problems"]
    (fault,) = result["faults"]
    assert fault["kind"] == "kill-in-save" and fault["during_save"]
    assert result["restarts"] == 1 and result["bitwise_equal"]
    # the half-written checkpoint of the step reached was skipped for the complete one before it
    assert fault["resumed_from"] == fault["step_reached"] - 2
    assert result["checkpoints_loaded_at_end"] == ["step-2", "step-4", "step-6"]


@pytest.mark.slow
def test_the_full_chaos_run(tmp_path: Path) -> None:
    """Kills (also mid-save) and stalls past the collective timeout, 4 ranks: the benchmark."""
    args = chaos.parse_args(["--work", str(tmp_path / "work"), "--out", str(tmp_path / "chaos")])
    result = chaos.run(args, tmp_path / "work")
    assert result["passed"], result["problems"]
    assert result["restarts"] == len(args.faults)


def example(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment(),
    )  # fmt: skip


@pytest.mark.parametrize("script", ["accelerate_lm.py", "trainer_lm.py"])
def test_the_examples_resume_auto_refuses_a_directory_that_is_not_a_run(
    tmp_path: Path, script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "notes.txt").write_text("not a run")
    args = ["--resume", "auto", "--output-dir", str(tmp_path)]
    if script == "trainer_lm.py":  # its one run as a program in the suite
        done = example(script, *args)
        assert done.returncode != 0
        message = done.stderr
    else:  # the script as python runs it, in this process (tests/test_examples.py runs it as a program)
        monkeypatch.syspath_prepend(str(ROOT / "examples"))
        monkeypatch.setattr(sys, "argv", [script, *args])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
        message = str(exit_info.value.code)  # a message: python prints it and exits with code 1
    assert f"--resume auto: --output-dir {tmp_path}" in message
    assert "Pass a new or empty --output-dir" in message
    assert (tmp_path / "notes.txt").read_text() == "not a run"  # left alone
