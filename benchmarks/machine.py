"""The machine a benchmark ran on, as its reports describe it."""

from __future__ import annotations

import contextlib
import os
import platform
from datetime import datetime, timezone
from pathlib import Path


def machine() -> dict[str, str]:
    """CPU model, cores, kernel, Python and torch versions, the date and the load average now."""
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):  # not Linux, or no model name: keep the above
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
