"""An iperf-like TCP throughput probe, run inside the emulated nodes.

    python linkprobe.py serve HOST PORT          # accept one connection, read until EOF, print JSON
    python linkprobe.py send HOST PORT MEGABYTES # send that many MB, print JSON

The receiver reports bytes and seconds from first to last byte; the sender reports its own view.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def serve(host: str, port: int) -> dict[str, float]:
    with socket.create_server((host, port)) as server:
        print("ready", flush=True)
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


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "serve":
        print(json.dumps(serve(argv[1], int(argv[2]))), flush=True)
        return 0
    if len(argv) >= 4 and argv[0] == "send":
        print(json.dumps(send(argv[1], int(argv[2]), float(argv[3]))), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
