"""An emulated cluster on one Linux machine: one network namespace per node, tbf-limited links.

Layout (``prefix`` defaults to ``dcab``; everything below is created and deleted by this module)::

    namespace dcab-sw:   bridge br0 <- v0, v1, ..., v{N-1}          (the "switch")
    namespace dcab-n{j}: lo + eth0 (10.77.0.{j+1}/24), peer of v{j}  (node j)

A node's ranks bind to ``eth0``'s address (``GLOO_SOCKET_IFNAME=eth0``). Traffic between two ranks
of the same node goes to a local address, which Linux routes over ``lo``: fast, never shaped. Traffic
to another node leaves through ``eth0``, crosses the bridge and enters the other node's ``eth0``.
Each node link is shaped like a full-duplex NIC: a ``tbf`` qdisc at ``rate`` on ``eth0`` (node ->
switch) and another on ``v{j}`` (switch -> node). netem is not needed and not used.

:class:`EmulatedCluster` is a context manager: it removes leftovers of a crashed run with the same
prefix before building, and deletes every namespace it made on exit, on exceptions, on Ctrl-C and
on SIGTERM (which it turns into ``SystemExit`` while the cluster is up). Deleting a namespace
deletes its veth ends, bridge and qdiscs with it; nothing is created in the host's own namespace.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from types import FrameType, TracebackType

logger = logging.getLogger(__name__)

__all__ = ["ClusterSpec", "EmulatedCluster", "missing_requirements", "namespaces_with_prefix"]


@dataclass(frozen=True)
class ClusterSpec:
    """The emulated machines and network."""

    nodes: int = 4
    """N: number of node namespaces."""
    rate_mbit: float = 1000.0
    """Each node link's rate per direction (tbf), Mbit/s."""
    prefix: str = "dcab"
    """Name prefix of every namespace; leftovers with this prefix are deleted at start."""
    subnet: str = "10.77.0"
    """First three octets of the /24 the node addresses come from (node j: .{j+1})."""
    burst_kb: int = 512
    """tbf bucket size; must exceed rate / HZ (1 Gbit/s at HZ=250: 500 KB)."""
    latency_ms: int = 50
    """tbf queue limit expressed as the longest a packet may wait."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 250:
            raise ValueError(f"nodes must be in 1..250, got {self.nodes}")
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        if not re.fullmatch(r"[a-z][a-z0-9]{1,7}", self.prefix):
            raise ValueError(f"prefix must be 2-8 lowercase letters/digits, got {self.prefix!r}")

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"


def missing_requirements() -> str | None:
    """Why an emulated cluster cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2)"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    logger.debug("$ %s", " ".join(argv))
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def namespaces_with_prefix(prefix: str) -> list[str]:
    """Network namespaces named ``{prefix}-...`` that exist now."""
    listing = _run("ip", "netns", "list").stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [name for name in names if name.startswith(f"{prefix}-")]


class EmulatedCluster:
    """Build the namespaces, bridge, veths and tbf qdiscs of ``spec``; tear them down on exit."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._previous_sigterm: signal.Handlers | object | None = None
        self._up = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> EmulatedCluster:
        reason = missing_requirements()
        if reason is not None:
            raise RuntimeError(f"cannot build an emulated cluster: {reason}")
        self._install_sigterm_handler()
        try:
            self.teardown()  # leftovers of a crashed run
            self._build()
        except BaseException:
            self.teardown()
            self._restore_sigterm_handler()
            raise
        self._up = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.teardown()
        finally:
            self._restore_sigterm_handler()
            self._up = False

    def teardown(self) -> None:
        """Delete every namespace with the prefix (and with it veths, bridge, qdiscs). Idempotent."""
        for name in namespaces_with_prefix(self.spec.prefix):
            _run("ip", "netns", "del", name, check=False)
        left = namespaces_with_prefix(self.spec.prefix)
        if left:
            raise RuntimeError(f"could not delete network namespaces {left}")

    def _install_sigterm_handler(self) -> None:
        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(f"terminated by signal {signum}: tearing the emulated cluster down")

        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # not the main thread: rely on try/finally only
            self._previous_sigterm = None

    def _restore_sigterm_handler(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
            self._previous_sigterm = None

    def _build(self) -> None:
        spec = self.spec
        sw = spec.switch_ns
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for node in range(spec.nodes):
            ns = spec.node_ns(node)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip", "-n", sw, "link", "add", f"v{node}", "type", "veth", "peer", "name", "eth0", "netns", ns
            )
            _run("ip", "-n", sw, "link", "set", f"v{node}", "master", "br0")
            _run("ip", "-n", sw, "link", "set", f"v{node}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{spec.address(node)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0")  # node -> switch
            self._shape(sw, f"v{node}")  # switch -> node
        logger.info(
            "emulated cluster up: %d nodes in namespaces %s..%s, %g Mbit/s per link and direction",
            spec.nodes,
            spec.node_ns(0),
            spec.node_ns(spec.nodes - 1),
            spec.rate_mbit,
        )

    def _shape(self, ns: str, dev: str) -> None:
        spec = self.spec
        _run(
            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{spec.rate_mbit:g}mbit", "burst", f"{spec.burst_kb}kb",
            "latency", f"{spec.latency_ms}ms",
        )  # fmt: skip

    # ------------------------------------------------------------------ use

    def exec_prefix(self, node: int) -> list[str]:
        """argv prefix that runs a command inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.spec.node_ns(node)]

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per node: (bytes sent node -> switch, bytes sent switch -> node) through the tbf qdiscs."""
        counts = []
        for node in range(self.spec.nodes):
            up = _tbf_bytes(self.spec.node_ns(node), "eth0")
            down = _tbf_bytes(self.spec.switch_ns, f"v{node}")
            counts.append((up, down))
        return counts


def _tbf_bytes(ns: str, dev: str) -> int:
    """Bytes the tbf qdisc on ``dev`` in ``ns`` has sent (``tc -s``)."""
    out = _run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
    match = re.search(r"qdisc tbf .*?Sent (\d+) bytes", out, re.S)
    if match is None:
        raise RuntimeError(f"no tbf qdisc on {dev} in {ns}: {out.strip()}")
    return int(match.group(1))
