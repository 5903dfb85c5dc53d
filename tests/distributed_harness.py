"""Start n gloo processes on 127.0.0.1, run a function on each, collect results, fail on hang.

The processes come from a fork server that has imported torch once (multiprocessing's
``forkserver``): a rank starts in a fraction of a second instead of importing torch anew, about 2 s
of CPU each under ``spawn``, which the distributed tests paid hundreds of times. As under ``spawn``,
every rank is a fresh process that shares nothing with the test process: the function and its
arguments travel pickled, the rank imports the test's module itself, and its environment is the
test process's at the call.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "pytest"]
"""What the fork server imports once for every rank: third-party modules only, so that a rank
imports this checkout's ``decentadam`` and ``tests`` by the test process's path, as under spawn."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    pg_timeout_s: float,
    env: dict[str, str],
) -> None:
    os.environ.clear()  # the test process's environment now, not the fork server's at its start
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        # By value: a tensor put on a torch.multiprocessing queue travels as a shared-memory file
        # descriptor, which is lost when this process exits before the parent has received it.
        payload = io.BytesIO()
        torch.save(value, payload)
        results.put((rank, "ok", payload.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    allow_missing: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    Raises AssertionError with the failing rank's traceback, or when the processes do not finish
    within ``timeout_s`` (a hang fails the test instead of stalling the suite). Ranks in
    ``allow_missing`` may die or hang without reporting (their result is None); they are killed at
    the end.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: at the first call
    results = ctx.Queue()
    port = free_port()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world_size), **(env or {})}
    processes = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, results, pg_timeout_s, child_env),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        expected = set(range(world_size)) - allow_missing
        while not expected <= set(collected):
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise AssertionError(
                    f"distributed run timed out after {timeout_s}s; finished ranks: {sorted(collected)}"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(processes)
                    if p.exitcode not in (None, 0) and r not in collected and r not in allow_missing
                ]
                if dead:
                    raise AssertionError(f"ranks {dead} died without reporting (exit codes)") from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for rank in allow_missing:  # stalled (or dead) on purpose: nothing to wait for
            processes[rank].kill()
        end = time.monotonic() + 5.0  # the others' grace to leave, together rather than each
        for process in processes:
            process.join(timeout=max(end - time.monotonic(), 0.0))
            if process.is_alive():
                process.kill()
                process.join()
    return [collected.get(rank) for rank in range(world_size)]
