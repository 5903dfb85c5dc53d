"""benchmarks/first_step.py: the first-step time from the output, the ranks' peak memory, and a run
stopped at its limit leaves no rank behind (torch's agent starts each rank in a session of its own)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks import first_step

RANK = """
import subprocess, sys, time
sleep = "import sys, time; time.sleep(float(sys.argv[1]))"
rank = [sys.executable, "-c", sleep, "{sleep}", "fake-rank"]
subprocess.Popen(rank, start_new_session=True)
time.sleep(0.5)
print("step 1/1 [", flush=True)
time.sleep({sleep})
"""


def test_first_step_is_read_from_the_output_and_a_stopped_run_leaves_no_rank(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--marker", r"1/1 \[", "--rank-match", "fake-rank", "--every", "0.1", "--out", str(out)]
    first_step.main([*argv, "--", sys.executable, "-c", RANK.format(sleep=1)])
    report = json.loads(out.read_text())
    assert report["exit_code"] == 0 and not report["stopped"] and 0.3 < report["first_step_s"] < 5
    assert len(report["peak_rss_gib_per_rank"]) == 1

    first_step.main([*argv, "--timeout-s", "1.5", "--", sys.executable, "-c", RANK.format(sleep=60)])
    report = json.loads(out.read_text())
    assert report["stopped"].endswith("timeout") and report["exit_code"] == -9
    time.sleep(0.5)
    left = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and "fake-rank" in first_step.command_line(int(pid))
    ]
    assert left == [], "a rank outlived the stopped run"
