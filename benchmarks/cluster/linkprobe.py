"""An iperf-like TCP throughput probe of the emulated cluster's links.

:func:`probe` runs concurrent streams between nodes, each end in its node's namespace::

    python -m benchmarks.cluster.linkprobe serve HOST            # listen on a free port, print "ready PORT",
                                                                 # read one connection until EOF, print JSON
    python -m benchmarks.cluster.linkprobe send HOST PORT MEGABYTES  # send that many MB, print JSON

The receiver reports bytes and seconds from first to last byte; the sender reports its own view.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from benchmarks.cluster.launch import REPO

if TYPE_CHECKING:
    from benchmarks.cluster.netns import EmulatedCluster

CHUNK = 1 << 20
MODULE = "benchmarks.cluster.linkprobe"


def serve(host: str) -> dict[str, float]:
    with socket.create_server((host, 0)) as server:
        print(f"ready {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            total, start = 0, 0.0
            buffer = bytearray(CHUNK)
            while True:
                got = conn.recv_into(buffer)
                if not got:
                    break
                if total == 0:
                    start = time.perf_counter()
                total += got
            seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "bytes_per_s": total / seconds if seconds > 0 else 0.0}


def send(host: str, port: int, megabytes: float) -> dict[str, float]:
    payload = b"\0" * CHUNK
    total = int(megabytes * 1e6)
    for _ in range(100):
        try:
            conn = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise RuntimeError(f"could not connect to {host}:{port}")
    with conn:
        start = time.perf_counter()
        sent = 0
        while sent < total:
            sent += conn.send(payload[: min(CHUNK, total - sent)])
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # EOF from the receiver: everything arrived
        seconds = time.perf_counter() - start
    return {"bytes": sent, "seconds": seconds, "bytes_per_s": sent / seconds}


def probe(cluster: EmulatedCluster, streams: list[tuple[int, int]], megabytes: float) -> dict[str, Any]:
    """Concurrent TCP streams (client node -> server node's address), ``megabytes`` each: the mean
    per-stream rate and the bytes that went through the tbf qdiscs meanwhile."""
    before = cluster.link_bytes()
    servers: list[subprocess.Popen[str]] = []
    ports = []
    try:
        for _, server_node in streams:
            argv = [sys.executable, "-m", MODULE, "serve", cluster.spec.address(server_node)]
            server = subprocess.Popen(
                [*cluster.exec_prefix(server_node), *argv], stdout=subprocess.PIPE, text=True, cwd=REPO
            )
            servers.append(server)
            assert server.stdout is not None
            ready = server.stdout.readline().split()  # "ready PORT"
            if ready[:1] != ["ready"] or len(ready) != 2:
                raise RuntimeError(f"link probe server in node {server_node} did not start: {ready}")
            ports.append(ready[1])
        clients = []
        for (client_node, server_node), port in zip(streams, ports, strict=True):
            host = cluster.spec.address(server_node)
            argv = [sys.executable, "-m", MODULE, "send", host, port, str(megabytes)]
            clients.append(
                subprocess.Popen(
                    [*cluster.exec_prefix(client_node), *argv], stdout=subprocess.DEVNULL, cwd=REPO
                )
            )
        for client in clients:
            if client.wait(timeout=120) != 0:
                raise RuntimeError(f"link probe client exited with {client.returncode}")
        results = [json.loads(server.communicate(timeout=60)[0]) for server in servers]
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
                server.wait()
    after = cluster.link_bytes()
    return {
        "streams": len(streams),
        "bytes": sum(r["bytes"] for r in results),
        "bytes_per_s": statistics.mean(r["bytes_per_s"] for r in results),
        "tbf_bytes": sum(a[0] - b[0] + a[1] - b[1] for a, b in zip(after, before, strict=True)),
    }


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        print(json.dumps(serve(argv[1])), flush=True)
        return 0
    if len(argv) >= 4 and argv[0] == "send":
        print(json.dumps(send(argv[1], int(argv[2]), float(argv[3]))), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
