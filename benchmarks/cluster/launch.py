"""One process per rank inside its node's namespace, with the environment torchrun would give it.

Shared by the cluster benchmark (its ``worker`` ranks) and ``benchmarks.time_to_quality`` (the
translation recipe's ranks). Rank ``r`` of ``N`` nodes x ``L`` runs in node ``r // L``'s namespace as
local rank ``r % L`` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, ``MASTER_ADDR`` = node 0's
address and ``MASTER_PORT`` = a port that is free in node 0's namespace when the ranks start.
``GLOO_SOCKET_IFNAME=eth0`` binds every rank to its node's address, so a same-node peer is reached
over ``lo`` and another node's ranks through the shaped link. One process per rank needs no launcher
agent per node and no rendezvous beyond gloo's own store.

Every child runs from the repository root (so ``python -m benchmarks...`` and ``-m recipes...``
import this checkout) with one thread, its output in a log file, in a session of its own:
:func:`run_all` waits for all of them and, on a failure or the deadline, stops exactly those.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.cluster.netns import EmulatedCluster

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
"""The repository root: the children's working directory."""
PROGRESS = ("step ", "done", "error")
"""Log lines that :func:`run_all` echoes (``echo=True``), and any line that mentions training pairs."""


@dataclass(frozen=True)
class Command:
    """One child process: what it runs, its environment on top of ours, and its log."""

    argv: tuple[str, ...]
    log: Path
    env: Mapping[str, str]


def environment(extra: Mapping[str, str]) -> dict[str, str]:
    """Ours, one thread per process, then ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def free_port(cluster: EmulatedCluster, node: int = 0) -> int:
    """A TCP port no one listens on in node ``node``'s namespace now (the kernel's pick for port 0)."""
    pick = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
    done = subprocess.run(
        [*cluster.exec_prefix(node), sys.executable, "-c", pick],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(done.stdout)


def rank_commands(
    cluster: EmulatedCluster,
    argv: Sequence[str],
    ranks_per_node: int,
    logs: Path,
    name: str,
    env: Mapping[str, str] | None = None,
) -> list[Command]:
    """``argv`` once per rank of ``cluster``'s nodes x ``ranks_per_node``, each in its node's namespace
    (logs ``{name}.rank{r}.log``); ``env`` goes to every rank."""
    world = cluster.spec.nodes * ranks_per_node
    port = free_port(cluster, 0)
    commands = []
    for rank in range(world):
        node, local = divmod(rank, ranks_per_node)
        rank_env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "MASTER_ADDR": cluster.spec.address(0),
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "eth0",  # bind to this node's address; same-node peers go over lo
            **(env or {}),
        }
        argv_in_node = (*cluster.exec_prefix(node), *argv)
        commands.append(Command(argv_in_node, logs / f"{name}.rank{rank}.log", rank_env))
    return commands


def run_all(commands: Sequence[Command], timeout_s: float, what: str, echo: bool = False) -> None:
    """Start every command and wait for all; on a failure or after ``timeout_s``, stop the others and
    raise RuntimeError with the failed one's log tail. ``echo``: log the first command's progress
    lines (evaluations, errors) as they appear."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for command in commands:
            with open(command.log, "wb") as sink:
                proc = subprocess.Popen(
                    command.argv,
                    env=environment(command.env),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=REPO,
                )
            procs.append((proc, command.log))
        _wait(procs, timeout_s, what, procs[0][1] if echo and procs else None)
    finally:
        for proc, _ in procs:  # only the processes started here, each by its own session id
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def _wait(
    procs: list[tuple[subprocess.Popen[bytes], Path]], timeout_s: float, what: str, echo: Path | None
) -> None:
    deadline = time.monotonic() + timeout_s
    shown = 0
    while True:
        if echo is not None:
            shown = _echo(echo, shown, what)
        if all(proc.poll() is not None for proc, _ in procs):
            break
        failed = [(proc, log) for proc, log in procs if proc.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            proc, log = failed[0] if failed else procs[0]
            why = f"exited with {proc.returncode}" if failed else f"timed out after {timeout_s:g} s"
            raise RuntimeError(f"{what}: a rank {why}; its log ({log}):\n{_tail(log)}")
        time.sleep(0.2)
    bad = [(proc, log) for proc, log in procs if proc.returncode != 0]
    if bad:
        proc, log = bad[0]
        raise RuntimeError(f"{what}: a rank exited with {proc.returncode}; its log ({log}):\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _echo(log: Path, shown: int, what: str) -> int:
    """Log the new complete lines of ``log`` that report progress; return how far it has read."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return shown
    end = text.rfind("\n") + 1
    for line in text[shown:end].splitlines():
        line = line.rsplit("\r", 1)[-1].strip()  # the last state of a progress-bar line
        if line.startswith(PROGRESS) or "training pairs" in line:
            logger.info("[%s] %s", what, line)
    return max(shown, end)
