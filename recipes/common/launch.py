"""How the ``compare.py`` scripts start a recipe's training (and its evaluation) in child processes.

:func:`accelerate_launch` is ``accelerate launch`` of a recipe module on this machine with a free
rendezvous port (the default 29500 may be held by another run), gloo on CPU processes unless
``gpu``. :func:`environment` makes the children import this same ``recipes`` package (its root
first on ``PYTHONPATH``) from whatever directory the caller runs in, so relative paths given on
the command line mean what they meant to the caller. :func:`run_logged` runs one, keeps its output
in a log file and echoes its progress lines.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ROOT", "accelerate_launch", "environment", "free_port", "run_logged", "torchrun"]

ROOT = Path(__file__).resolve().parents[2]
"""The directory that holds the ``recipes`` and ``eval`` packages (the repository root)."""


def free_port() -> int:
    """A TCP port that no one listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def accelerate_launch(module: str, processes: int, *, gpu: bool = False) -> list[str]:
    """``accelerate launch -m MODULE`` on ``processes`` processes of this machine; append its arguments."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1",
        "--main_process_port", str(free_port()), "--dynamo_backend", "no",
        "--mixed_precision", "bf16" if gpu else "no",
    ]  # fmt: skip
    if processes > 1:
        command += ["--multi_gpu", "--num_processes", str(processes)]
    else:
        command += ["--num_processes", "1"]
    return [*command, "-m", module]


def torchrun(module: str, processes: int, *, max_restarts: int = 0) -> list[str]:
    """``torchrun -m MODULE`` on ``processes`` processes of this machine (its own rendezvous on a free
    port), restarting all of them up to ``max_restarts`` times when one fails; append its arguments."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", "-m", module,
    ]  # fmt: skip


def environment(*, gpu: bool = False) -> dict[str, str]:
    """The children's environment: this ``recipes`` package first on the path, one thread per process,
    and Accelerate on CPU unless ``gpu``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if not gpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def run_logged(
    command: list[str],
    log: Path,
    prefix: str,
    *,
    env: dict[str, str] | None = None,
    echo: tuple[str, ...] = ("step ", "done", "error"),
) -> float:
    """Run ``command`` with its output in ``log``; print the lines that start with one of ``echo``.

    Returns the wall seconds; a non-zero exit raises RuntimeError with the end of the log.
    """
    print(f"$ {shlex.join(command)}", flush=True)
    begin = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or environment()
        )
        assert process.stdout is not None
        for line in process.stdout:
            handle.write(line)
            text = line.rsplit("\r", 1)[-1].strip()  # the last state of a tqdm line
            if text.startswith(echo):
                print(f"  [{prefix}] {text}", flush=True)
        code = process.wait()
    if code != 0:
        tail = log.read_text().splitlines()[-30:]
        raise RuntimeError(f"{prefix} failed with exit code {code}; the end of {log}:\n" + "\n".join(tail))
    return time.perf_counter() - begin
