"""The emulated cluster's per-rank launcher (benchmarks.cluster.launch) and link probe: what every
rank gets, failures and deadlines that stop the others, free ports; and that the cluster benchmark
refuses to start without decent-dp instead of installing it.

The tests that build namespaces need root and iproute2 (``ip``, ``tc``) and are skipped otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks.cluster import run
from benchmarks.cluster.launch import REPO, Command, free_port, rank_commands, run_all
from benchmarks.cluster.linkprobe import probe
from benchmarks.cluster.netns import ClusterSpec, EmulatedCluster, namespaces_with_prefix

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root and iproute2 (ip, tc) to create network namespaces",
)
PREFIX = f"dcl{os.getpid() % 100000}"  # unique per test process: parallel runs do not collide


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_children_run_from_the_repository_root_with_one_thread_and_their_env(tmp_path: Path) -> None:
    show = "import json, os; print(json.dumps([os.getcwd(), os.environ['OMP_NUM_THREADS'], os.environ['X']]))"
    run_all([Command(python(show), tmp_path / "a.log", {"X": "1"})], timeout_s=60, what="env")
    assert json.loads((tmp_path / "a.log").read_text()) == [str(REPO), "1", "1"]


def test_a_failed_rank_stops_the_others_and_shows_its_log(tmp_path: Path) -> None:
    pid_file = tmp_path / "sleeper.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    failing = "import time, sys; time.sleep(1); print('the reason'); sys.exit(3)"
    commands = [
        Command(python(sleeper), tmp_path / "sleeper.log", {}),
        Command(python(failing), tmp_path / "failing.log", {}),
    ]
    with pytest.raises(RuntimeError, match=r"(?s)fail: a rank exited with 3; its log .*the reason"):
        run_all(commands, timeout_s=60, what="fail")
    with pytest.raises(ProcessLookupError):  # killed and reaped before run_all returned
        os.kill(int(pid_file.read_text()), 0)


def test_the_deadline_stops_every_rank(tmp_path: Path) -> None:
    commands = [Command(python("import time; time.sleep(60)"), tmp_path / "r.log", {})]
    with pytest.raises(RuntimeError, match=r"slow: a rank timed out after 0\.5 s"):
        run_all(commands, timeout_s=0.5, what="slow")


def test_progress_lines_of_the_first_rank_are_echoed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    code = "print('noise'); print('step 10 loss 3.2'); print('done')"
    with caplog.at_level(logging.INFO, logger="benchmarks.cluster.launch"):
        run_all([Command(python(code), tmp_path / "r.log", {})], timeout_s=60, what="m", echo=True)
    assert [r.getMessage() for r in caplog.records] == ["[m] step 10 loss 3.2", "[m] done"]


def test_decent_dp_comes_from_the_bench_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "decent_dp", None)  # as if it were not installed
    reason = run.missing_decent_dp()
    assert reason is not None and "pip install -e '.[bench]'" in reason
    monkeypatch.setitem(sys.modules, "decent_dp", sys)  # any module: "installed"
    assert run.missing_decent_dp() is None


@needs_netns
def test_the_benchmark_refuses_to_start_without_decent_dp(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "decent_dp", None)
    assert run.main(["--quick", "--prefix", PREFIX]) == 2
    assert "decent-dp is not installed" in capsys.readouterr().err
    assert namespaces_with_prefix(PREFIX) == []  # refused before building anything


@needs_netns
def test_ranks_run_in_their_nodes_with_torchrun_s_environment(tmp_path: Path) -> None:
    # a rank can bind its node's address only inside that node's namespace
    code = (
        "import json, os, socket\n"
        "node = int(os.environ['RANK']) // int(os.environ['LOCAL_WORLD_SIZE'])\n"
        "socket.socket().bind(('10.77.0.%d' % (node + 1), 0))\n"
        "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'GLOO_SOCKET_IFNAME',"
        " 'X')\n"
        "print(json.dumps({k: os.environ[k] for k in keys}))\n"
    )
    with EmulatedCluster(ClusterSpec(nodes=2, rate_mbit=100, prefix=PREFIX)) as cluster:
        ports = {free_port(cluster, 0) for _ in range(3)}
        assert all(1024 <= port < 65536 for port in ports)
        commands = rank_commands(cluster, python(code), 2, tmp_path, "t", env={"X": "y"})
        prefixes = [c.argv[:4] for c in commands]
        assert prefixes == [("ip", "netns", "exec", f"{PREFIX}-n{rank // 2}") for rank in range(4)]
        run_all(commands, timeout_s=60, what="ranks")
    seen = [json.loads((tmp_path / f"t.rank{rank}.log").read_text()) for rank in range(4)]
    assert [(s["RANK"], s["LOCAL_RANK"]) for s in seen] == [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")]
    assert {(s["WORLD_SIZE"], s["MASTER_ADDR"], s["GLOO_SOCKET_IFNAME"], s["X"]) for s in seen} == {
        ("4", "10.77.0.1", "eth0", "y")
    }
    assert len({s["MASTER_PORT"] for s in seen}) == 1


@needs_netns
def test_link_probe_across_and_inside_nodes() -> None:
    with EmulatedCluster(ClusterSpec(nodes=2, rate_mbit=100, prefix=PREFIX)) as cluster:
        across = probe(cluster, [(0, 1), (1, 0)], 4.0)  # both ways at once, on ports the kernel picks
        inside = probe(cluster, [(0, 0)], 1.0)
    assert across["streams"] == 2 and across["bytes"] == 8_000_000
    assert across["tbf_bytes"] >= 2 * 8_000_000  # each byte through an uplink and a downlink
    # tbf holds each direction at 100 Mbit/s = 12.5 MB/s (its 512 KB burst passes at once)
    assert 0 < across["bytes_per_s"] < 1.5 * 100e6 / 8
    assert inside["bytes"] == 1_000_000 and inside["tbf_bytes"] < 100_000  # over lo, not shaped
