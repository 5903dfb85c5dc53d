"""The emulated cluster's set-up and teardown: a 2-node cluster, connectivity, shaping, nothing left after.

Needs root and iproute2 (``ip``, ``tc``); skipped with the reason otherwise. About a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cluster.netns import (
    ClusterSpec,
    EmulatedCluster,
    missing_requirements,
    namespaces_with_prefix,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip, tc) to create network namespaces",
)

PREFIX = f"dct{os.getpid() % 100000}"  # unique per test process: parallel runs do not collide


def _in(cluster: EmulatedCluster, node: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cluster.exec_prefix(node), *argv], capture_output=True, text=True, timeout=30)


def _send(cluster: EmulatedCluster, src: int, dst: int, nbytes: int) -> None:
    """Send nbytes over TCP from node src to node dst's address (a tiny one-shot receiver on a port
    the kernel picks)."""
    host = cluster.spec.address(dst)
    receiver = subprocess.Popen(
        [
            *cluster.exec_prefix(dst),
            sys.executable,
            "-c",
            "import socket,sys\n"
            f"s=socket.create_server(('{host}', 0)); print(s.getsockname()[1], flush=True); c,_=s.accept()\n"
            "n=0\n"
            "while (b := c.recv(1 << 16)): n += len(b)\n"
            "print(n)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert receiver.stdout is not None
    port = int(receiver.stdout.readline())
    sender = _in(
        cluster,
        src,
        sys.executable,
        "-c",
        f"import socket; c=socket.create_connection(('{host}', {port})); c.sendall(b'x' * {nbytes}); "
        "c.close()",
    )
    assert sender.returncode == 0, sender.stderr
    out, _ = receiver.communicate(timeout=30)
    assert int(out.split()[-1]) == nbytes


def test_requirements_are_met_here() -> None:
    assert missing_requirements() is None


def test_two_node_cluster_connects_shapes_and_disappears() -> None:
    spec = ClusterSpec(nodes=2, rate_mbit=100, prefix=PREFIX)
    with EmulatedCluster(spec) as cluster:
        assert sorted(namespaces_with_prefix(PREFIX)) == [f"{PREFIX}-n0", f"{PREFIX}-n1", f"{PREFIX}-sw"]
        addresses = _in(cluster, 0, "ip", "-4", "-o", "addr", "show", "dev", "eth0").stdout
        assert "10.77.0.1/24" in addresses
        qdiscs = _in(cluster, 1, "tc", "qdisc", "show", "dev", "eth0").stdout
        assert "tbf" in qdiscs and "100Mbit" in qdiscs

        before = cluster.link_bytes()
        _send(cluster, 0, 1, 200_000)  # across the bridge: through node 0's uplink and node 1's downlink
        after = cluster.link_bytes()
        assert after[0][0] - before[0][0] >= 200_000
        assert after[1][1] - before[1][1] >= 200_000

        before = cluster.link_bytes()
        _send(cluster, 0, 0, 200_000)  # same node, its own address: over lo, never through tbf
        after = cluster.link_bytes()
        assert after[0][0] - before[0][0] < 10_000
    assert namespaces_with_prefix(PREFIX) == []


def test_teardown_after_an_exception_and_leftovers_are_cleaned() -> None:
    spec = ClusterSpec(nodes=2, prefix=PREFIX)
    with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(spec):
        assert len(namespaces_with_prefix(PREFIX)) == 3
        raise RuntimeError("boom")
    assert namespaces_with_prefix(PREFIX) == []

    # a crashed run leaves a namespace behind: the next cluster removes it before building
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-n7"], check=True)
    try:
        with EmulatedCluster(spec):
            assert f"{PREFIX}-n7" not in namespaces_with_prefix(PREFIX)
    finally:
        subprocess.run(["ip", "netns", "del", f"{PREFIX}-n7"], capture_output=True)
    assert namespaces_with_prefix(PREFIX) == []


def test_sigterm_tears_down() -> None:
    script = (  # run from the repository root: `python -c` imports the benchmarks package from there
        "import time\n"
        "from benchmarks.cluster.netns import ClusterSpec, EmulatedCluster\n"
        f"with EmulatedCluster(ClusterSpec(nodes=2, prefix={PREFIX!r})):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    assert len(namespaces_with_prefix(PREFIX)) == 3
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert "terminated by signal" in err
    assert namespaces_with_prefix(PREFIX) == []


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="prefix"):
        ClusterSpec(prefix="Bad-Name")
    with pytest.raises(ValueError, match="nodes"):
        ClusterSpec(nodes=0)
