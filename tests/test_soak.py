"""The soak (``python -m benchmarks.soak``): threads, open files, memory and process groups stay flat while
DecentralizedAdam (aer, both overlaps) and A2CiD2 exchange, and come back once the optimizer goes.

The default suite runs a short soak (a few hundred steps per mode); ``pytest -m slow`` runs the full
one, whose numbers docs/testing.md reports.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks import soak

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="samples /proc (Linux)")


def test_a_short_soak_keeps_threads_files_memory_and_groups_flat() -> None:
    config = {
        "modes": list(soak.MODES),
        "steps": 300,
        "a2cid2_steps": 300,
        "sample_every": 50,
        "a2cid2_step_ms": 1.0,
    }
    for mode, records in soak.run(config).items():
        summary = soak.summarize(mode, records, warmup=100)
        assert soak.check(summary, rss_bound_mib=2.0) == [], summary
        exchanges = [row["exchanges"] for row in summary["ranks"]]
        assert all(e == 300 for e in exchanges) if mode != "a2cid2" else all(e > 30 for e in exchanges)


def record(steps: int = 4) -> dict[str, Any]:
    """A made-up rank record whose resources stay flat."""

    def at(step: int) -> dict[str, Any]:
        resources = {"os_threads": 8, "python_threads": 2, "fds": 20, "process_groups": 3, "rss_mib": 300.0}
        return {
            "step": step,
            "exchanges": step,
            "time": float(step),
            "fd_kinds": {"socket": 12, "pipe": 8},
            **resources,
        }

    before = {**at(0), "process_groups": 1, "os_threads": 4, "fds": 10, "fd_kinds": {"pipe": 10}}
    return {
        "before": before,
        "samples": [at(s) for s in range(0, steps + 1)],
        "closed": before,
        "released": before,
    }


def test_check_names_what_grew() -> None:
    assert soak.check(soak.summarize("aer-step", [record()], warmup=1), rss_bound_mib=2.0) == []
    grown = copy.deepcopy(record())
    grown["samples"][3]["fds"] += 1
    grown["samples"][3]["fd_kinds"]["socket"] += 1
    grown["samples"][4]["rss_mib"] += 3.0
    grown["released"] = {**grown["released"], "process_groups": 2}
    grown["closed"] = {**grown["closed"], "os_threads": 5}
    summary = soak.summarize("aer-step", [grown], warmup=1)
    problems = soak.check(summary, rss_bound_mib=2.0)
    assert problems == [
        "aer-step rank 0: fds changed by [1] after warm-up",
        "aer-step rank 0: RSS grew 3.00 MiB after warm-up (> 2.0)",
        "aer-step rank 0: os_threads 5 after close(), 4 before the optimizer was built",
        "aer-step rank 0: process_groups 2 once the closed optimizer was dropped, 1 before it was built",
    ]
    assert summary["ranks"][0]["fd_changes"] == [{"step": 3, "kinds": {"socket": 1}}]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_full_soak(tmp_path: Path) -> None:
    """21,000 steps of each aer mode and 90,000 of A2CiD2 (about 11 minutes on 2 cores)."""
    assert soak.main(["--out", str(tmp_path / "soak")]) == 0, (tmp_path / "soak.md").read_text()


def test_the_committed_soak_passes_todays_check_and_its_report_is_made_from_its_json(tmp_path: Path) -> None:
    """docs/testing.md quotes benchmarks/results/soak.{json,md}: today's check on that JSON finds
    nothing, the report is what that JSON gives, and the run is as long as the docs say."""
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "soak.json"
    payload = json.loads(committed.read_text())
    assert soak.problems_of(payload) == [] == payload["problems"]
    assert committed.with_suffix(".md").read_text() == soak.report(payload)
    assert all(row["exchanges"] >= 20_000 for summary in payload["summaries"] for row in summary["ranks"])
    copy_ = shutil.copy(committed, tmp_path / "soak.json")
    assert soak.main(["--check", str(copy_)]) == 0
    assert (tmp_path / "soak.md").read_text() == soak.report(payload)

    broken = copy.deepcopy(payload)
    broken["summaries"][0]["ranks"][1]["changes"]["fds"] = [1]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert soak.main(["--check", str(tmp_path / "broken.json")]) == 1
    assert "Verdict: bounds broken:" in (tmp_path / "broken.md").read_text()
