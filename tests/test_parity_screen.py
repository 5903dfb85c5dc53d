"""benchmarks.parity.screen: its table reads the runs' logs and compares each with All-Reduce's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.parity.screen import SCREENS, main, table


def write_log(path: Path, curve: dict[int, float]) -> None:
    lines = ["some warning"] + [
        json.dumps({"step": s, "valid_nll": v, "seconds": 1.0}) for s, v in curve.items()
    ]
    path.write_text("\n".join(lines) + "\n")


def test_the_table_compares_each_run_with_all_reduce_of_its_language_and_seed(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    write_log(other / "de-ar-2e-3.log", {100: 5.0, 200: 4.0})
    write_log(tmp_path / "de-node-aer-2e-3.log", {100: 5.25, 200: 4.5})  # stopped early: no 300
    write_log(tmp_path / "de-ar-s2.log", {100: 6.0, 200: 3.0})
    write_log(tmp_path / "de-node-aer-s2.log", {100: 6.5, 200: 3.125})
    markdown = table(tmp_path, [other])
    assert "| de-node-aer-2e-3 | 5.250 (+0.250) | 4.500 (+0.500) |" in markdown
    assert "| de-node-aer-s2 | 6.500 (+0.500) | 3.125 (+0.125) |" in markdown
    assert "| de-ar-s2 | 6.000 | 3.000 |" in markdown


def test_seeds_beyond_two_and_bleu_have_their_own_all_reduce(tmp_path: Path) -> None:
    write_log(tmp_path / "de-ar-s1.log", {100: 5.0})
    write_log(tmp_path / "de-ar-s3.log", {100: 6.0})
    write_log(tmp_path / "de-node-aer-s3.log", {100: 6.5})
    write_log(tmp_path / "de-node-aer-s1.log", {100: 5.125})
    write_log(tmp_path / "de-node-complete-s12.log", {100: 7.0})  # no All-Reduce of seed 12
    with (tmp_path / "de-ar-s3.log").open("a") as log:
        log.write(json.dumps({"bleu": 30.5, "chrf": 55.0}) + "\n")
    with (tmp_path / "de-node-aer-s3.log").open("a") as log:
        log.write(json.dumps({"bleu": 29.75, "chrf": 54.0}) + "\n")
    markdown = table(tmp_path)
    assert "| run | 100 | BLEU |" in markdown
    assert "| de-node-aer-s3 | 6.500 (+0.500) | 29.75 (-0.75) |" in markdown
    assert "| de-node-aer-s1 | 5.125 (+0.125) |  |" in markdown
    assert "| de-ar-s3 | 6.000 | 30.50 |" in markdown
    assert "| de-node-complete-s12 | 7.000 |  |" in markdown
    assert all(name.endswith(("-s1", "-s2", "-s3", "-s4")) for name in SCREENS["seeds-1200"])
    shared = {name: args for name, args in SCREENS["shared-seeds-1200"].items() if "-node-" in name}
    assert len(shared) == 7 and all("optim.share_second_moment_every=2" in args for args in shared.values())


def test_only_names_runs_of_the_screen(tmp_path: Path) -> None:
    assert "de-node-complete-2e-3" in SCREENS["lr"]
    with pytest.raises(SystemExit):
        main(["--screen", "seeds", "--data", "x", "--out", str(tmp_path), "--only", "no-such-run"])
