"""Time to the first training step and peak memory per rank of a launched recipe (issue 23, item 3).

Runs a command (``accelerate launch ...``) in its own process group and, every ``--every`` seconds,
reads ``VmHWM`` (the kernel's peak resident set size) of every process below it whose command line
contains ``--rank-match`` (one per rank; the launcher itself does not match). The first step is the
first output line that matches ``--marker`` (a regular expression): the recipe's own line ``first
optimizer step`` by default, or the progress bar's ``1/N`` for code without that line. The command
is stopped when it runs past ``--timeout-s`` or when the machine's available memory falls under
``--min-available-gib`` (so a run that would exhaust a shared machine is cut short, and reported as
such, with the peak memory it had reached). Prints one JSON line: seconds from the launch to the
first step, each rank's peak RSS when the first step was seen and over the whole run::

    python -m benchmarks.first_step --out report.json -- \
        accelerate launch ... -m recipes.translation.train ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def children(root: int) -> list[int]:
    """Every process below ``root`` (from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def peak_rss_gib(pid: int) -> float | None:
    """``VmHWM`` of ``pid`` in GiB, None once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def available_gib() -> float:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def measure(command: list[str], args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, bufsize=0
    )
    marker = re.compile(args.marker)
    first_step: list[float] = []

    def read() -> None:
        assert process.stdout is not None
        pending = b""
        while chunk := process.stdout.read(4096):
            if log:
                log.write(chunk.decode(errors="replace"))
                log.flush()
            pending += chunk
            *lines, pending = re.split(rb"[\r\n]", pending)
            if not first_step and any(marker.search(line.decode(errors="replace")) for line in lines):
                first_step.append(time.time() - started)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peaks: dict[int, float] = {}
    at_first_step: list[float] = []
    stopped = ""
    lowest = available_gib()
    while process.poll() is None:
        for pid in children(process.pid):
            if args.rank_match in command_line(pid) or pid in peaks:
                peak = peak_rss_gib(pid)
                if peak is not None:
                    peaks[pid] = max(peak, peaks.get(pid, 0.0))
        if first_step and not at_first_step:  # the peaks up to the first step (evaluation comes next)
            at_first_step.extend(sorted(peaks.values(), reverse=True))
        available = available_gib()
        lowest = min(lowest, available)
        elapsed = time.time() - started
        if not stopped and (elapsed > args.timeout_s or available < args.min_available_gib):
            stopped = f"stopped after {elapsed:.0f} s: " + (
                "timeout" if elapsed > args.timeout_s else f"only {available:.1f} GiB available"
            )
            # The launcher's group, and each rank: torch's elastic agent starts every rank in a
            # session of its own, so killing the group alone leaves them running.
            running = set(peaks) | set(children(process.pid))
            os.killpg(process.pid, signal.SIGKILL)
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(args.every)
    reader.join(timeout=10)
    if log:
        log.close()
    ranks = sorted(peaks.values(), reverse=True)
    return {
        "command": " ".join(command),
        "first_step_s": round(first_step[0], 1) if first_step else None,
        "total_s": round(time.time() - started, 1),
        "exit_code": process.returncode,
        "stopped": stopped,
        "peak_rss_gib_per_rank_at_first_step": [round(p, 2) for p in at_first_step],
        "peak_rss_gib_per_rank": [round(p, 2) for p in ranks],
        "lowest_available_gib": round(lowest, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }


def main(argv: list[str] | None = None) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--marker", default=r"first optimizer step", help="regex of the first-step line")
    parser.add_argument("--rank-match", default="recipes.translation.train", help="text in a rank's command")
    parser.add_argument("--timeout-s", type=float, default=2400.0)
    parser.add_argument("--min-available-gib", type=float, default=3.0)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between memory readings")
    parser.add_argument("--log", default="", help="file for the command's output")
    parser.add_argument("--out", default="", help="also write the JSON report here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    report = measure(command, args)
    text = json.dumps(report)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
