r"""Predict the per-iteration time of All-Reduce and of each gossip topology on a given cluster.

Use it before committing a cluster to a run::

    python -m decentadam.runtime_model --params 350M --compute-ms 180 --nodes 8 --gpus-per-node 4 \
        --inter-gbps 25

prints the predicted iteration time of DDP-style All-Reduce and of DecentralizedAdam with each
topology, each one's speed-up over All-Reduce, and which to use.

Inputs (all measurable without running the training job itself)
---------------------------------------------------------------
``C``        compute time of one forward + backward on one rank (a fraction ``f`` of it is forward).
``S``        parameter bytes (what one rank sends per full-model exchange).
``N, L``     nodes, ranks per node (ranks ``j*L .. j*L+L-1`` share node ``j``).
``B_inter``  bandwidth of one node's network link, per direction (full duplex), bytes/s.
``B_intra``  bandwidth of one rank-to-rank connection inside a node, bytes/s.
``a_inter, a_intra``  latency of one message on those links.
``U_ar``     time of the optimizer step after All-Reduce (AdamW on the whole model), ``U_dec`` time of
             DecentralizedAdam's step (mix + AccumAdamW + copy into the send buffer). Both are local,
             memory-bandwidth-bound work; measure them once for the model on the target hardware.
``P, k``     with ``second_moment="group_gradient"``: the values of one gradient sum (``P = numel``)
             that DecentralizedAdam sends with the parameters to the group of every ``k``-th step;
             a group of two sums them in bfloat16 (``G = 2 P`` bytes), a larger group in float32
             (``G = 4 P``). A step whose exchange carries it sums ``S + G`` bytes instead of ``S``,
             so ``G / k`` more per step on average.
``intra_node`` with ``"all_reduce"`` (``Setting(intra_node="all_reduce")``): before every
             update the ``L`` ranks of each node all-reduce their gradients, and with
             ``second_moment="group_gradient"`` their squares too: ``S_node = 2 S`` bytes (``S``
             without the squares, ``node_squares=False``), over the node's links: a ring of ``L``
             ranks that takes ``T_node = 2 (L-1)/L * S_node / B_intra + 2 (L-1) a_intra`` and sends
             ``2 (L-1)/L * S_node`` per rank, none across nodes. The parameters are then
             exchanged on the topology built for the ``N`` nodes (:func:`decentadam.topology.over_nodes`):
             a group is all ranks of its nodes, and a node alone sends nothing (the even steps of
             ``aer`` on 2 nodes). Not applied to All-Reduce.
``P, k_A``   with ``share_second_moment_every=k_A`` (``intra_node="all_reduce"``, ``group_gradient``):
             the node's second moment (``P = numel`` values, bfloat16: ``2 P`` bytes) travels with
             the parameters of every ``k_A``-th exchange, ``2 P / k_A`` more per step on average.
``P, K``     with ``second_moment="global"``: each rank's second-moment estimate (``P`` values,
             bfloat16: ``2 P`` bytes) travels with the parameters of every exact average over all
             ranks (every ``K``-th step, ``average_every=K``), ``2 P / K`` more per step on average.
             :func:`predict_setting` predicts a whole :class:`~decentadam.options.Setting` (the
             default's included) with these workload fields set from it.

Communication: one group sum is a ring all-reduce (gloo and NCCL both use rings for large buffers)
--------------------------------------------------------------------------------------------------
A ring all-reduce of ``S`` bytes over ``g`` ranks is a reduce-scatter plus an all-gather: every
rank sends ``2 (g-1)/g * S`` bytes to its successor in the ring, in ``2 (g-1)`` steps. The ring
visits the group's ranks in rank order, so a group spanning ``m`` nodes crosses every node boundary
once per direction: each node's uplink carries ``2 (g-1)/g * S`` for that group (All-Reduce over
``n = N L`` ranks: ``2 (n-1)/n * S`` per node link, whatever ``L`` is; hierarchical NCCL trees do
better only in latency). A ring is as fast as its slowest edge. The groups of one topology round run
at the same time and share node links, so an inter-node edge ``a -> b`` drains at

    t_edge = max(out_load(node a), in_load(node b)) / B_inter

where ``out_load``/``in_load`` add the bytes of every ring edge of the round that leaves/enters that
node (e.g. one-peer-exp pairing ranks 0<->2 and 1<->3 puts ``2 S`` on each node link); an intra-node
edge takes ``bytes / B_intra``. The group's time is

    T_group = max over its ring edges of t_edge  +  2 (g-1) * a_ring

with ``a_ring`` the largest latency on the ring. Groups of one rank do not communicate.

Hierarchical group sums (``hierarchical=True``: DecentralizedAdam on gloo)
----------------------------------------------------------------------
A group that spans ``q >= 2`` nodes with ``m >= 2`` of its ranks on each is summed in three phases:
a reduce-scatter inside each node (direct sends: ``(m-1)/m * S`` out of each rank, at ``B_intra``), an
all-reduce of each ``S/m`` shard over the ``q`` nodes (``m`` rails, each a ring of ``q`` ranks with
``2 (q-1)/q * S/m`` per edge; the ``m`` rails of a node share its link, which carries
``2 (q-1)/q * S`` per direction; :mod:`decentadam.collectives` says what that saves against a flat
ring) and an all-gather inside each node (as the reduce-scatter). The phases of successive
buckets pipeline: a bucket's all-gather and the next bucket's reduce-scatter run while a rail
carries a bucket, so in the recursion below a bucket occupies its ranks' channel for the slowest
phase and arrives after all three (``T_G`` is their sum, ``T_G^max`` the slowest).

Per-iteration time: a max-plus recursion over ranks and steps
------------------------------------------------------------
DecentralizedAdam works bucket by bucket (``K = ceil(S / bucket_mb)`` buckets, each ``S/K`` bytes and
``U_dec/K`` of update work). Rank ``i`` updates bucket ``k`` of step ``t-1`` at ``d_ik(t-1)`` and
immediately starts that bucket's exchange with its group ``G`` of step ``t``; the group's buckets
travel one after the other over its ring, so bucket ``k`` arrives at

    b_Gk(t) = max_{j in G} max(d_jk(t-1), free_j);   a_Gk(t) = b_Gk(t) + T_G / K

where ``free_j`` is when rank ``j``'s channel can take the next bucket: ``b_Gk(t) + T_G^max / K``
after it began the previous one (``T_G^max = T_G`` for a flat ring), so a rank's exchanges (an
earlier bucket, or a bucket of the previous step still in flight) share its links one after the
other.

With ``overlap="step"`` the rank computes for ``C_i`` after its last update, then for each bucket in
turn waits for it, mixes and updates::

    c = d_i,K-1(t-1) + C_i;   for k: c = max(c, a_Gk(t)) + U_dec / K;  d_ik(t) = c

so the exchange of bucket 0 already travels while buckets 1..K-1 are being updated (the update and
the communication overlap, unlike DDP's optimizer step, which needs every reduced gradient). Where
the update and the communication compete for the same CPU cores (``update_overlaps_comm=False``)
no update runs while bytes are on the wire: every exchange starts after the last bucket's update
(``d_ik(t) = d_i,K-1(t)``) and the first bucket's update waits for the last bucket to arrive. With
``overlap="backward"`` (and decent-dp, which updates from backward hooks) bucket ``k``'s update runs
inside backward, after the layers of bucket ``k``: ``c = d_i,K-1(t-1) + f C_i``, then for each
bucket ``c += (1-f) C_i / K`` before the wait/update.

With ``intra_node="all_reduce"`` each bucket's update also waits for the node's sum of its
gradients. With ``overlap="step"`` the node's ranks start their sums when the last of them ends
backward, at ``e = max_{j in node} (d_j,K-1(t-1) + C_j)``; the buckets' sums travel one after the
other, and bucket ``k``'s update becomes ``c = max(c, a_Gk(t), e + (k+1) T_node / K) + U_dec / K``: the
sums overlap no forward or backward, only the update of earlier buckets (with
``update_overlaps_comm=False`` not that either: the first update waits for all of them). With
``overlap="backward"`` a bucket's hook starts its sum and waits for it, so before bucket ``k``'s update
``c = max(max_{j in node} c_j + T_node / K, a_Gk(t))``. The node's sums take the intra-node links and
do not queue behind the parameter exchange (``free_j``).

All-Reduce (DDP): the gradient buckets (of ``bucket_mb``) become ready during backward, in reverse
layer order; bucket ``k`` is reduced once every rank has produced it and the previous bucket is
done; the optimizer step follows the last one, and everyone starts the next forward in step::

    s(t) = max_i e_i(t-1);  ready_k = max_i (s + f C_i + (k+1)/K (1-f) C_i)
    done_k = max(ready_k, done_{k-1}) + T_AR * size_k / S;  e_i(t) = max(s + C_i, done_K) + U_ar

The predicted iteration time is the average slope of the step ends over many periods of the topology, which
takes care of AER's alternation (a node pair uses the slow link only every other step, and a node
may catch up on its intra-node steps) and of stragglers (``C_i`` differs for one rank).
With equal ranks and no update time it reduces to the familiar bounds

    All-Reduce:  ~ f C + max((1-f) C, 2 (n-1)/n * S / B_inter)
    gossip:      ~ max(C, T_G)  averaged over the rounds, i.e. communication fully hidden when T_G < C;
                 with intra_node="all_reduce", ~ max(C + T_node, T_G) with the groups over nodes.

``lower_bound`` is the same recursion with ``U = 0``: the time if the optimizer step were free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from decentadam.collectives import node_layout
from decentadam.options import INTRA_NODE, Global, GroupGradient, Setting
from decentadam.topology import Group, Round, Topology, build, changing_groups, has_global_round, over_nodes

__all__ = [
    "ALLREDUCE",
    "METHODS",
    "Cluster",
    "Prediction",
    "Workload",
    "group_phase_times",
    "group_sum_times",
    "predict",
    "predict_all",
    "predict_setting",
    "ring_edges",
    "workload_of",
]

logger = logging.getLogger(__name__)

ALLREDUCE = "all-reduce"
METHODS = (ALLREDUCE, "complete", "ring", "one-peer-exp", "aer")


@dataclass(frozen=True)
class Cluster:
    """The machines: nodes of ranks joined by one network link per node."""

    nodes: int
    """N: number of nodes."""
    ranks_per_node: int
    """L: ranks (GPUs, processes) per node."""
    inter_bytes_per_s: float
    """B_inter: one node's link bandwidth, per direction (full duplex)."""
    intra_bytes_per_s: float
    """B_intra: bandwidth of one rank-to-rank connection inside a node."""
    inter_latency_s: float = 0.0
    """a_inter: latency of one message between nodes."""
    intra_latency_s: float = 0.0
    """a_intra: latency of one message inside a node."""

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("inter_bytes_per_s", "intra_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("inter_latency_s", "intra_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class Workload:
    """What one rank does per iteration."""

    param_bytes: float
    """S: bytes of trainable parameters (sent per full-model exchange)."""
    compute_s: float
    """C: forward + backward time of one rank."""
    forward_fraction: float = 1.0 / 3.0
    """f: share of C spent in forward (All-Reduce can only overlap backward)."""
    update_s: float = 0.0
    """U_dec: DecentralizedAdam's step (mix + AccumAdamW + copy to the send buffer)."""
    allreduce_update_s: float = 0.0
    """U_ar: the optimizer step after All-Reduce (torch AdamW)."""
    bucket_bytes: float = 25 * 2**20
    """Gradient bucket size of All-Reduce (DDP's bucket_cap_mb)."""
    update_overlaps_comm: bool = True
    """Whether a bucket's exchange travels while later buckets are updated. True where communication
    needs no cores the update uses (GPUs with NCCL/RDMA, spare CPU cores); False where the update
    saturates the cores that also move the bytes (many gloo ranks per CPU): updates and exchanges
    then take turns, as if ``K = 1``."""
    overlap: str = "step"
    """Where DecentralizedAdam updates: ``"step"`` (after backward) or ``"backward"`` (bucket hooks)."""
    compute_scale: tuple[float, ...] = ()
    """Per-rank multipliers of C (a straggler: (1, 2, 1, ...)); empty: all ranks equal."""
    hierarchical: bool = False
    """Whether DecentralizedAdam sums multi-node groups hierarchically (it does on gloo, not on NCCL)."""
    gradient_values: float = 0.0
    """P: values of the gradient sum of ``second_moment="group_gradient"`` (``numel``), sent with the
    parameters every ``v_every`` steps, 2 bytes each to a group of two (bfloat16), 4 to a larger one
    (float32); 0: another second moment, no gradient is sent."""
    v_every: int = 2
    """k: DecentralizedAdam's ``v_every``, the steps between two gradient sums."""
    update_values: float = 0.0
    """P: with ``exchange="bf16_updates"`` the values of the update sent in place of the parameters,
    2 bytes each (bfloat16); 0: the parameters travel (``param_bytes``)."""
    intra_node: str = "gossip"
    """DecentralizedAdam's ``intra_node``: ``"gossip"`` (every rank is a worker of the topology) or
    ``"all_reduce"`` (every step the ranks of a node all-reduce their gradients, and their squares
    with ``node_squares``, before updating, and only nodes gossip; see the module doc). All-Reduce
    ignores it."""
    node_squares: bool = True
    """With ``intra_node="all_reduce"``: whether the node's all-reduce carries ``g**2`` with ``g``
    (``second_moment="group_gradient"``, ``2 S`` bytes) or only ``g`` (the other second moments, ``S``)."""
    moment_values: float = 0.0
    """P: with ``share_second_moment_every`` the values of the node's second moment sent with the
    parameters every ``share_every`` steps, 2 bytes each (bfloat16); 0: not shared."""
    share_every: int = 2
    """k_A: ``GroupGradient(share_second_moment_every)``, the steps between two such sums."""
    global_moment_values: float = 0.0
    """P: with ``second_moment="global"`` the values of each rank's second-moment estimate sent
    (bfloat16, 2 bytes each) with every exact average over all ranks; 0: another second moment."""

    def __post_init__(self) -> None:
        if not self.param_bytes > 0:
            raise ValueError(f"param_bytes must be > 0, got {self.param_bytes}")
        if not self.gradient_values >= 0:
            raise ValueError(f"gradient_values must be >= 0, got {self.gradient_values}")
        if self.v_every < 1:
            raise ValueError(f"v_every must be >= 1, got {self.v_every}")
        if not self.update_values >= 0:
            raise ValueError(f"update_values must be >= 0, got {self.update_values}")
        if self.intra_node not in INTRA_NODE:
            raise ValueError(f"intra_node must be 'gossip' or 'all_reduce', got {self.intra_node!r}")
        if not self.moment_values >= 0:
            raise ValueError(f"moment_values must be >= 0, got {self.moment_values}")
        if not self.global_moment_values >= 0:
            raise ValueError(f"global_moment_values must be >= 0, got {self.global_moment_values}")
        if self.share_every < 1:
            raise ValueError(f"share_every must be >= 1, got {self.share_every}")
        if self.moment_values and self.intra_node != "all_reduce":
            raise ValueError(
                f"moment_values={self.moment_values:g}: the nodes' second moment is shared only with "
                "intra_node='all_reduce'; set it, or leave moment_values 0"
            )
        if self.intra_node == "all_reduce" and self.gradient_values:
            raise ValueError(
                f"gradient_values={self.gradient_values:g}: with intra_node='all_reduce' the node's "
                "all-reduce gives second_moment='group_gradient' its estimate and no gradient travels "
                "with the parameters; leave gradient_values 0"
            )
        for name in ("compute_s", "update_s", "allreduce_update_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.forward_fraction <= 1:
            raise ValueError(f"forward_fraction must be in [0, 1], got {self.forward_fraction}")
        if not self.bucket_bytes > 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")
        if self.overlap not in ("step", "backward"):
            raise ValueError(f"overlap must be 'step' or 'backward', got {self.overlap!r}")
        if any(not s > 0 for s in self.compute_scale):
            raise ValueError(f"compute_scale entries must be > 0, got {self.compute_scale}")

    def compute_of(self, rank: int) -> float:
        scale = self.compute_scale[rank] if rank < len(self.compute_scale) else 1.0
        return self.compute_s * scale

    def exchange_bytes(self, step: int, group: Group) -> float:
        """Bytes one rank sums with its ``group`` of ``step``: the parameters (or their bfloat16
        update, ``exchange="bf16_updates"``), and every ``v_every``-th step the gradient of
        ``second_moment="group_gradient"`` (bfloat16 in a group of two, float32 in a larger one), and
        every ``share_every``-th step the node's second moment (bfloat16)."""
        sent = 2 * self.update_values if self.update_values else self.param_bytes
        if step % self.share_every == 0:
            sent += 2 * self.moment_values
        if step % self.v_every:
            return sent
        return sent + self.gradient_values * (2 if len(group) == 2 else 4)

    def round_bytes(self, topology: Topology, step: int) -> dict[Group, float]:
        """:meth:`exchange_bytes` of each group of ``step``, and a group of all ranks (an exact
        average) also the ranks' second-moment estimates of ``second_moment="global"``."""
        world = topology.world_size

        def extra(group: Group) -> float:
            return 2 * self.global_moment_values if world > 1 and len(group) == world else 0.0

        return {group: self.exchange_bytes(step, group) + extra(group) for group in topology.groups(step)}

    def node_sum_bytes(self) -> float:
        """Bytes of the node's gradient all-reduce of one step: ``2 S`` (``g`` and ``g**2``), ``S``
        (``g``, without ``node_squares``), or 0 (``intra_node="gossip"``)."""
        if self.intra_node != "all_reduce":
            return 0.0
        return (2 if self.node_squares else 1) * self.param_bytes

    def rounds(self, topology: Topology) -> int:
        """Steps after which the topology's groups and the gradient sums repeat."""
        period = math.lcm(topology.period, self.v_every) if self.gradient_values else topology.period
        return math.lcm(period, self.share_every) if self.moment_values else period


@dataclass(frozen=True)
class Prediction:
    """Predicted per-iteration times of one method (seconds)."""

    method: str
    iteration_s: float
    """The recursion with the optimizer-step times: the prediction to compare with a measurement."""
    lower_bound_s: float
    """The recursion with free optimizer steps: max(C, communication) in the simple cases."""
    comm_s: float
    """Mean over steps of the slowest group's communication time (no compute, no waiting), plus
    ``node_sum_s``."""
    inter_bytes_per_rank: float
    """Mean bytes per iteration that one rank sends across node links."""
    sent_bytes_per_rank: float = field(default=0.0)
    """Mean bytes per iteration that one rank sends (ring all-reduce traffic, intra + inter),
    ``node_sum_bytes_per_rank`` included."""
    node_sum_s: float = 0.0
    """With ``intra_node="all_reduce"``: seconds of the slowest node's gradient all-reduce, every step."""
    node_sum_bytes_per_rank: float = 0.0
    """With ``intra_node="all_reduce"``: bytes one rank sends per iteration in its node's gradient
    all-reduce, ``2 (L-1)/L * S_node`` (``Workload.node_sum_bytes``), all inside the node."""


def ring_edges(group: Group) -> list[tuple[int, int]]:
    """The ring of a group sum: members in rank order, each sending to the next."""
    if len(group) < 2:
        return []
    return [(group[i], group[(i + 1) % len(group)]) for i in range(len(group))]


Bytes = float | Mapping[Group, float]
"""What the groups of a round sum: the same bytes for every group, or each group's."""


def _bytes_of(nbytes: Bytes, group: Group) -> float:
    return nbytes if isinstance(nbytes, (int, float)) else nbytes[group]


def group_sum_times(
    groups: Sequence[Group], cluster: Cluster, nbytes: Bytes, hierarchical: bool = False
) -> dict[Group, float]:
    """Seconds until each concurrent group of a round has summed ``nbytes`` (see the module doc).

    Groups of one rank take 0. Inter-node ring edges of all groups share their nodes' links. With
    ``hierarchical``, a group that spans nodes evenly takes the sum of its three phases.
    """
    return {g: sum(phases) for g, phases in group_phase_times(groups, cluster, nbytes, hierarchical).items()}


_Phase = tuple[int, list[tuple[Group, float]]]


def _rings(group: Group, cluster: Cluster, nbytes: float, hierarchical: bool) -> list[_Phase]:
    """The phases of one group sum: (passes, concurrent (ring, bytes per ring edge)), where passes is
    2 for an all-reduce (2 (g-1) messages around a ring of g) and 1 for a reduce-scatter or an
    all-gather (g-1 messages)."""
    if len(group) < 2:
        return []
    nodes = node_layout(group, cluster.ranks_per_node) if hierarchical else None
    if nodes is None:
        return [(2, [(group, 2 * (len(group) - 1) / len(group) * nbytes)])]
    m, q = len(nodes[0]), len(nodes)
    intra = [(members, (m - 1) / m * nbytes) for members in nodes]
    rails = [(tuple(members[j] for members in nodes), 2 * (q - 1) / q * nbytes / m) for j in range(m)]
    return [(1, intra), (2, rails), (1, intra)]


def group_phase_times(
    groups: Sequence[Group], cluster: Cluster, nbytes: Bytes, hierarchical: bool = False
) -> dict[Group, tuple[float, ...]]:
    """Seconds of each phase of each concurrent group's sum: one phase for a flat ring, three for a
    hierarchical sum (reduce-scatter in the nodes, all-reduce across them, all-gather)."""
    out_load = [0.0] * cluster.nodes
    in_load = [0.0] * cluster.nodes
    phases_of = {group: _rings(group, cluster, _bytes_of(nbytes, group), hierarchical) for group in groups}
    for phases in phases_of.values():
        for _, phase in phases:
            for ring, per_edge in phase:
                for a, b in ring_edges(ring):
                    na, nb = cluster.node_of(a), cluster.node_of(b)
                    if na != nb:
                        out_load[na] += per_edge
                        in_load[nb] += per_edge
    times: dict[Group, tuple[float, ...]] = {}
    for group, phases in phases_of.items():
        if not phases:
            times[group] = (0.0,)
            continue
        phase_times = []
        for passes, phase in phases:
            seconds = 0.0
            for ring, per_edge in phase:
                slowest, latency = 0.0, 0.0
                for a, b in ring_edges(ring):
                    na, nb = cluster.node_of(a), cluster.node_of(b)
                    if na != nb:
                        slowest = max(slowest, max(out_load[na], in_load[nb]) / cluster.inter_bytes_per_s)
                        latency = max(latency, cluster.inter_latency_s)
                    else:
                        slowest = max(slowest, per_edge / cluster.intra_bytes_per_s)
                        latency = max(latency, cluster.intra_latency_s)
                seconds = max(seconds, slowest + passes * (len(ring) - 1) * latency)
            phase_times.append(seconds)
        times[group] = tuple(phase_times)
    return times


def _round_traffic(groups: Round, cluster: Cluster, nbytes: Bytes, hierarchical: bool) -> tuple[float, float]:
    """(mean bytes sent per rank, mean inter-node bytes sent per rank) for one round."""
    sent, inter = 0.0, 0.0
    for group in groups:
        for _, phase in _rings(group, cluster, _bytes_of(nbytes, group), hierarchical):
            for ring, per_edge in phase:
                for a, b in ring_edges(ring):
                    sent += per_edge
                    if cluster.node_of(a) != cluster.node_of(b):
                        inter += per_edge
    return sent / cluster.world_size, inter / cluster.world_size


def _slope(ends: list[list[float]]) -> float:
    """Average per-step time over the second half of a recursion (rows: steps, columns: ranks)."""
    first = len(ends) // 2
    steps = len(ends) - 1 - first
    return sum(b - a for a, b in zip(ends[first], ends[-1], strict=True)) / (len(ends[0]) * steps)


def _nodes(cluster: Cluster) -> list[Group]:
    """The ranks of each node."""
    local = cluster.ranks_per_node
    return [tuple(range(j * local, (j + 1) * local)) for j in range(cluster.nodes)]


def _node_sum_times(cluster: Cluster, work: Workload) -> dict[Group, float]:
    """Seconds of each node's gradient all-reduce with ``intra_node="all_reduce"`` (nodes of one rank:
    0); empty with ``"gossip"``."""
    if work.intra_node != "all_reduce":
        return {}
    return group_sum_times(_nodes(cluster), cluster, work.node_sum_bytes())


def _topology(method: str, cluster: Cluster, work: Workload) -> Topology:
    """The schedule of a gossip ``method``: over the nodes with ``intra_node="all_reduce"``."""
    if work.intra_node == "all_reduce":
        return over_nodes(method, cluster.world_size, cluster.ranks_per_node)
    return build(method, cluster.world_size, cluster.ranks_per_node)


def _simulate_gossip(
    topology: Topology, cluster: Cluster, work: Workload, update_s: float, steps: int
) -> float:
    """The per-bucket recursion of the module docstring; returns the mean step time."""
    n = cluster.world_size
    buckets = max(1, math.ceil(work.param_bytes / work.bucket_bytes))
    u = update_s / buckets
    f = work.forward_fraction
    cycle = work.rounds(topology)
    comm = [
        group_phase_times(topology.groups(t), cluster, work.round_bytes(topology, t), work.hierarchical)
        for t in range(cycle)
    ]
    node_sums = {node: seconds for node, seconds in _node_sum_times(cluster, work).items() if seconds}
    backward = work.overlap == "backward"
    ends = [[0.0] * n]
    done = [[0.0] * n for _ in range(buckets)]  # done[k][i]: rank i updated bucket k (exchange starts)
    channel = [0.0] * n  # when rank i's previous exchange finished: its exchanges go one at a time
    for t in range(steps):
        start = ends[-1]
        cursor = [start[i] + (f if backward else 1.0) * work.compute_of(i) for i in range(n)]
        arrived = [[0.0] * n for _ in range(buckets)]
        for k in range(buckets):
            for group, phases in comm[t % cycle].items():
                if len(group) > 1:
                    began = max(max(done[k][j], channel[j]) for j in group)
                    for i in group:
                        arrived[k][i] = began + sum(phases) / buckets
                        channel[i] = began + max(phases) / buckets
        if not backward:  # intra_node="all_reduce": the node's sums start once its backward ends
            for node, seconds in node_sums.items():
                began = max(cursor[j] for j in node)
                for k in range(buckets):
                    for i in node:
                        arrived[k][i] = max(arrived[k][i], began + (k + 1) * seconds / buckets)
        if not work.update_overlaps_comm:  # no update while any bucket is still on the wire
            arrived = [[max(arrived[k][i] for k in range(buckets)) for i in range(n)]] * buckets
        for k in range(buckets):
            if backward:
                for i in range(n):
                    cursor[i] += (1 - f) * work.compute_of(i) / buckets  # the layers of bucket k
                for node, seconds in node_sums.items():  # the hook sums bucket k and waits for it
                    began = max(cursor[j] for j in node)
                    for i in node:
                        cursor[i] = began + seconds / buckets
            for i in range(n):
                cursor[i] = max(cursor[i], arrived[k][i]) + u
                done[k][i] = cursor[i]
        if not work.update_overlaps_comm:
            for k in range(buckets):
                done[k] = list(cursor)
        ends.append(cursor)
    return _slope(ends)


def _simulate_allreduce(cluster: Cluster, work: Workload, update_s: float, steps: int) -> float:
    n = cluster.world_size
    total = group_sum_times([tuple(range(n))], cluster, work.param_bytes)[tuple(range(n))]
    buckets = max(1, math.ceil(work.param_bytes / work.bucket_bytes))
    sizes = [work.bucket_bytes] * (buckets - 1) + [work.param_bytes - work.bucket_bytes * (buckets - 1)]
    f = work.forward_fraction
    ends = [[0.0] * n]
    for _ in range(steps):
        start = max(ends[-1])
        done = start
        for k, size in enumerate(sizes):
            ready = max(
                start + f * work.compute_of(i) + (k + 1) / buckets * (1 - f) * work.compute_of(i)
                for i in range(n)
            )
            done = max(ready, done) + total * size / work.param_bytes
        ends.append([max(start + work.compute_of(i), done) + update_s for i in range(n)])
    return _slope(ends)


def predict(method: str | Topology, cluster: Cluster, work: Workload, periods: int = 8) -> Prediction:
    """Predict one method: ``"all-reduce"``, a topology name of :func:`decentadam.topology.build`, or a
    built :class:`~decentadam.topology.Topology` of the cluster's ranks (``Setting.schedule``'s, with
    its exact averages and its nodes' groups as they are)."""
    n = cluster.world_size
    if isinstance(method, Topology):
        if method.world_size != n:
            raise ValueError(f"topology {method.name!r} is of {method.world_size} ranks, the cluster of {n}")
        built, method = method, method.name
    else:
        built = None
    if work.compute_scale and len(work.compute_scale) != n:
        raise ValueError(f"compute_scale has {len(work.compute_scale)} entries for {n} ranks")
    if method == ALLREDUCE:
        topology = build("complete", n, cluster.ranks_per_node)
        steps = max(48, 2 * periods)
        iteration = _simulate_allreduce(cluster, work, work.allreduce_update_s, steps)
        bound = _simulate_allreduce(cluster, work, 0.0, steps)
    else:
        topology = built if built is not None else _topology(method, cluster, work)
        if work.update_values and changing_groups(topology) is not None and not has_global_round(topology):
            raise ValueError(
                f"exchange='bf16_updates' needs one fixed group per rank or exact averages over all ranks; "
                f"{method} changes them and has none"
            )
        steps = max(48, work.rounds(topology) * periods)  # the slope is taken over the second half
        iteration = _simulate_gossip(topology, cluster, work, work.update_s, steps)
        bound = _simulate_gossip(topology, cluster, work, 0.0, steps)
    comm, sent, inter = 0.0, 0.0, 0.0
    gossip = method != ALLREDUCE
    hierarchical = work.hierarchical and gossip
    cycle = work.rounds(topology) if gossip else topology.period
    for t in range(cycle):
        nbytes: Bytes = work.round_bytes(topology, t) if gossip else work.param_bytes
        times = group_sum_times(topology.groups(t), cluster, nbytes, hierarchical)
        comm += max(times.values())
        round_sent, round_inter = _round_traffic(
            topology.rounds[t % topology.period], cluster, nbytes, hierarchical
        )
        sent += round_sent
        inter += round_inter
    node_s = max(_node_sum_times(cluster, work).values(), default=0.0) if gossip else 0.0
    node_sent = 0.0
    if gossip and node_s:
        node_sent, _ = _round_traffic(tuple(_nodes(cluster)), cluster, work.node_sum_bytes(), False)
    return Prediction(
        method,
        iteration,
        bound,
        comm / cycle + node_s,
        inter / cycle,
        sent / cycle + node_sent,
        node_sum_s=node_s,
        node_sum_bytes_per_rank=node_sent,
    )


def predict_all(cluster: Cluster, work: Workload, methods: Sequence[str] = METHODS) -> list[Prediction]:
    """Predictions for every method that can be built on this cluster (others are skipped with a log)."""
    predictions = []
    for method in methods:
        try:
            predictions.append(predict(method, cluster, work))
        except ValueError as error:
            logger.info("skipping %s: %s", method, error)
    return predictions


def workload_of(setting: Setting, work: Workload, values: float | None = None) -> Workload:
    """``work`` with what ``setting`` sends (its exchange, its nodes' all-reduce, its second moment's
    bytes) in place of those fields; ``values``: the model's parameter count (None: ``S / 4``, float32)."""
    values = work.param_bytes / 4 if values is None else values
    moment = setting.second_moment
    nodes = setting.intra_node == "all_reduce"
    return Workload(
        **{
            **{name: getattr(work, name) for name in work.__dataclass_fields__},
            "update_values": values if setting.exchange == "bf16_updates" else 0.0,
            "intra_node": setting.intra_node,
            "node_squares": isinstance(moment, GroupGradient),
            "gradient_values": values if isinstance(moment, GroupGradient) and not nodes else 0.0,
            "v_every": setting.v_every or 2,
            "moment_values": values if setting.share_every else 0.0,
            "share_every": setting.share_every or 2,
            "global_moment_values": values if isinstance(moment, Global) else 0.0,
        }
    )


def predict_setting(
    setting: Setting, cluster: Cluster, work: Workload, values: float | None = None, periods: int = 8
) -> Prediction:
    """:func:`predict` of DecentralizedAdam with ``setting`` on ``cluster`` (its schedule from
    :meth:`Setting.schedule`, with its exact averages; the workload's exchange fields from
    :func:`workload_of`, ``values`` parameters): the steady state, after a synchronous warm-up
    (``sync_steps``) if any.
    Raises ValueError where the setting cannot be built for the cluster, as the optimizer would."""
    topology = setting.schedule(cluster.world_size, cluster.ranks_per_node)
    return predict(topology, cluster, workload_of(setting, work, values), periods)
