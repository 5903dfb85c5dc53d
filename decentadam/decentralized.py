"""DecentralizedAdam: local AccumAdamW steps plus neighbour averaging that overlaps compute."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from decentadam import buckets as bucketing
from decentadam import distributed
from decentadam.backward import BackwardSchedule
from decentadam.buckets import AveragedParameters, Bucket, views_like
from decentadam.collectives import (
    CLOSE_TIMEOUT,
    NO_TIMEOUT,
    Closable,
    CommStats,
    Communicator,
    ExchangeGroupsReleased,
    Handle,
    default_communicator,
)
from decentadam.optim.accum_adamw import (
    MomentSource,
    ParamsT,
    check_group,
    corrected_second_moment,
    is_count,
    make_defaults,
    step_group,
)
from decentadam.topology import (
    Group,
    Topology,
    changing_groups,
    has_global_round,
    over_nodes,
    resolve,
    with_global_average,
)

__all__ = ["EXCHANGES", "INTRA_NODE", "SECOND_MOMENTS", "CommStats", "DecentralizedAdam", "LocalUpdate"]

logger = logging.getLogger(__name__)

Overlap = Literal["step", "backward"]
SecondMoment = Literal["all_ranks", "local", "group_gradient", "global"]
SECOND_MOMENTS: tuple[SecondMoment, ...] = ("all_ranks", "local", "group_gradient", "global")
IntraNode = Literal["gossip", "all_reduce"]
INTRA_NODE: tuple[IntraNode, ...] = ("gossip", "all_reduce")
Exchange = Literal["parameters", "bf16_updates"]
EXCHANGES: tuple[Exchange, ...] = ("parameters", "bf16_updates")
LocalUpdate = Callable[[dict[Tensor, dict[str, Any]], dict[str, Any], list[Tensor], MomentSource], None]
"""``fn(state, group, params, source)``: update ``params`` (those of one bucket with a gradient) in
place; ``source`` says which second moment the AccumAdamW update divides by."""
LEGACY_GROUP_KEYS = ("noise_ranks", "floor_ranks", "v_every")
"""Param-group keys that states saved by earlier versions carry; loading drops them (the second
moment's source is the optimizer's, not the groups')."""


class DecentralizedAdam(Optimizer):
    r"""Decentralized AccumAdamW: each rank keeps its own parameters and averages with neighbours.

    For the ``t``-th call of :meth:`step` (``t = 0, 1, 2, ...``), on rank ``i``::

        x_i(t+1) = (1 - lr * weight_decay) * sum_j W_ij(t) x_j(t) - lr * D_i(t)

    where ``W(t) = topology.mixing_matrix(t)`` (rank ``i`` averages uniformly with the other members
    of its group at step ``t``) and ``D_i(t)`` is rank ``i``'s AccumAdamW direction from its own
    gradient, computed at ``x_i(t)``: the decoupled weight decay applies to the mixed parameters, as
    the update runs right after the mixing. Adam moments never leave the rank.

    Second moment. A rank's gradient comes from a ``1/n`` share of the global batch, so it holds
    ``n`` times the noise variance of the mean gradient that All-Reduce's Adam divides by; with its
    own second moment every rank takes shorter steps wherever noise dominates (rare tokens, the
    softmax), and the average of the ranks' steps is shorter than All-Reduce's step.
    ``second_moment="all_ranks"`` (the default) removes that share on each rank from an estimate of
    its own gradient noise (AccumAdamW with ``noise_ranks = n``, the world size; no communication,
    one more buffer per parameter); ``"local"`` keeps each rank's own second moment (DAdam, and with
    ``accum_steps > 1`` the AccumAdam of Wang et al.). docs/parity.md has the measurements.

    ``second_moment="group_gradient"`` estimates it from gradients of the same step instead, which a
    noise estimate over time cannot separate from the mean gradient's drift (docs/parity.md, section
    6). Every ``v_every`` (``k``) steps, on steps whose exchange group has more than one member, a
    rank also sends its gradient, rounded to bfloat16, to that group with its parameters (an
    asynchronous sum that travels during the next forward/backward like them). When the sum
    arrives, at the next step, with ``gbar`` the group's mean over its ``q`` ranks and ``g_i`` the
    rank's own rounded gradient::

        z = gbar**2 - (g_i**2 - gbar**2) * (1/q - 1/n) / (1 - 1/q)   # E[z] = mu^2 + sigma^2 / n
        A = beta2**k * A + (1 - beta2**k) * z;   u = u + 1
        v = max(A / (1 - beta2**(k u)), V / (1 - beta2**t) / n)       # in place of all_ranks' v

    (``E[gbar^2] = mu^2 + sigma^2 / q``, ``E[g_i^2 - gbar^2] = sigma^2 (1 - 1/q)``; on a group of all
    ``n`` ranks ``z`` is ``gbar^2``, All-Reduce's.) Until the first sum arrives the step is
    ``"all_ranks"``'s; the momentum stays the rank's own. ``A`` and ``u`` are the state keys
    ``group_sq`` and ``group_updates``; a sum still in flight is waited for and folded into ``A`` by
    :meth:`state_dict`, :meth:`wait_for_exchanges` (so by averaging and checkpoints) and
    :meth:`close`. The sum of a group of two ranks travels in bfloat16, ``gbar = bf16(g_a + g_b) /
    2``: one rounding, and bitwise the same on both ranks (``a + b`` commutes), for ``numel * 2 / k``
    bytes per step on top of the parameters' (a quarter of float32 parameters' at ``k = 2``). A
    larger group's travels in float32, ``numel * 4 / k``: the order in which gloo adds its members
    is not fixed, and a bfloat16 sum of many values would lose precision. Memory: ``A``, and per
    bucket a bfloat16 copy of the gradient and a send buffer per group size (bfloat16 for pairs,
    float32 for larger groups).

    Gradients averaged inside nodes. With ``intra_node="all_reduce"`` the ``L = local_world_size``
    ranks of a node (consecutive ranks) all-reduce their gradients before each step, as DDP does
    (over the node's fast link), and take the same step from the node's mean gradient: they stay
    replicas, and only the ``N = n / L`` nodes gossip, on ``topology`` built for the ``N`` nodes
    (:func:`decentadam.topology.over_nodes`; a node alone does not communicate). A rank's step and
    the point where it takes its next gradient then carry the noise of ``L`` ranks' batches, not of
    one. The all-reduce sends the gradient bytes on the fast link (none more across nodes); with
    ``second_moment="group_gradient"`` it sends ``g**2`` with ``g`` (twice the bytes), so that the
    estimate needs no bytes of its own and no delay: with ``g_L`` the node's mean of ``g`` and
    ``s_L`` its mean of ``g**2`` minus ``g_L**2`` (``E[s_L] = sigma^2 (1 - 1/L)``), every step,
    before the update::

        z = g_L**2 - s_L * (1/L - 1/n) / (1 - 1/L)    # E[z] = mu^2 + sigma^2 / n, the same on the node
        A = beta2 * A + (1 - beta2) * z;   u = u + 1;   v = max(A / (1 - beta2**u), V / (1 - beta2**t) / N)

    (``V`` is of ``g_L``; ``"all_ranks"`` corrects the node's mean for ``N`` instead of ``n``, and
    ``"local"`` keeps the node's own.) docs/parity.md measures it. A parameter without a gradient
    on a rank counts as a zero gradient there, and after the step every parameter's ``.grad``
    holds the node's mean gradient. Memory: per bucket a buffer of its parameters' size (twice it
    with ``"group_gradient"``, for ``g**2``), and ``A`` with ``"group_gradient"``.

    The nodes' second moment shared. Where a gradient is sparse within a step (an embedding row
    whose token only one rank of one node saw), All-Reduce's step needs that node to step ``N``
    times its own Adam step, and the nodes' own ``A`` and the floor ``V / N`` allow ``sqrt(N)``.
    With ``intra_node="all_reduce"`` and ``"group_gradient"``, ``share_second_moment_every=k``
    (off by default, 0) sends the node's ``A``, rounded to bfloat16, with the parameters of
    every k-th step to the group of that step (an asynchronous sum, like the parameters'); when it
    arrives, at the next step and before that step's ``z`` joins it, ``A`` becomes the group's mean::

        A = bf16sum_{ranks j of the group}(bf16(A_j)) / q;   A = beta2 * A + (1 - beta2) * z
        v = max(A / (1 - beta2**u), V / (1 - beta2**t) / N**2)        # the floor lowered to V / N**2

    (``A`` is alike on a node's ranks, so the mean over the group's ``q`` ranks is the mean over its
    nodes; ``u`` counts the updates as before.) With the nodes' mean ``A`` and the floor
    ``V / N**2``, a node alone in seeing a token steps ``N`` times its own step there, and the mean
    of the nodes' steps is All-Reduce's; either change alone does not give it. docs/parity.md,
    section 14, has the arithmetic and the runs (measured on 2 nodes). The sum travels in bfloat16 for
    any group size: ``numel * 2 / k`` bytes per step on top of the parameters' (1 byte per parameter
    and step at ``k = 2``); it arrives alike on every member, so the ranks of a node stay replicas.
    Over two nodes of two ranks with gloo's hierarchical sum it is rounded once (but for a bucket's
    last ``numel % L`` values); a flat ring (NCCL, more nodes) may round it at every hop, which leaves
    ``A`` within a few bfloat16 roundings (2**-9 each) of its exact mean. A sum in flight is folded
    into the state by :meth:`state_dict`, :meth:`wait_for_exchanges` and :meth:`close`, as the
    gradient sums are, so a resume is exact. Memory: per bucket one bfloat16 buffer. It is off by
    default because its bytes can cost more time than its steps save: on Multi30k (2 nodes x 2) it
    halves the nodes' gap to All-Reduce at 1,200 steps on En-De (0.040 to 0.019 nats, less on
    En-Fr), but on the emulated slow link, where the exchange bounds the step, its steps were 21%
    longer and it reached All-Reduce's loss 18% later (docs/parity.md, section 16). Turn it on where
    the exchange still hides behind compute with it (the runtime model,
    :mod:`decentadam.runtime_model`, with ``--share-second-moment-every 2``, tells).

    Updates instead of parameters. With ``exchange="bf16_updates"`` a rank sends, in bfloat16, how
    far its parameters moved from a reference point ``r`` that every member of its group holds
    bitwise alike, instead of its float32 parameters (half the bytes). With ``q_i = bf16(x_i - r)``
    and the group's sum ``S`` of the ``q``'s over its ``m`` ranks, the mixing is::

        x_i = x_i + S / m - q_i;   r = r + S / m

    so the group's mean of ``x`` is exactly the mean of what its ranks held (``sum_i (S/m - q_i)
    = 0``), each rank keeps its own rounding residual (sent with its next update), and the ranks'
    parameters differ only by those residuals: the same mixing as ``"parameters"`` up to a rounding
    of the step (2**-9 of it), not of the weights. ``r`` starts at the broadcast parameters and is
    optimizer state (the key ``exchange_ref``, one copy of the parameters), so checkpoints and
    exact resumes carry it (a state saved without it, or with other groups, is resumed with one
    exchange of the whole parameters, after which ``r`` is their mean). It needs every rank to
    average with one fixed group (``topology="complete"``; with ``intra_node="all_reduce"``, any
    topology over 2 nodes): a rank that meets different peers would need a reference per peer.
    The sum must arrive bitwise the same on every member, as gloo's and NCCL's all-reduce deliver
    it (each element is reduced once and then copied), or ``r`` would drift apart. Memory: ``r``,
    and per bucket two bfloat16 buffers (the update sent and the sum received).

    Communication overlaps compute: at the end of step ``t`` each bucket of parameters
    (:mod:`decentadam.buckets`) starts an asynchronous sum of ``x_i(t+1)`` over its group of step
    ``t+1`` (:mod:`decentadam.collectives`), which travels during the next forward/backward; step
    ``t+1`` waits for it just before mixing. ``overlap="backward"`` also steps each bucket from
    gradient hooks once its gradients are final (:mod:`decentadam.backward`); it cannot be used
    where gradients must be seen whole first (global gradient-norm clipping, fp16 loss scalers,
    gradient accumulation over several backward passes: the last raises).

    A synchronous warm-up. With ``sync_steps=W`` the first ``W`` steps wait for their exchange
    right after the update and mix at once, so every rank takes its next gradient at the mixed
    point (on the complete graph, the ranks' mean: each rank's Adam direction, averaged); later
    steps overlap as above. The bytes and the arithmetic of the exchange are the same; only ``W``
    exchanges no longer hide behind compute. That a rank takes its gradient at its own point,
    ``x_bar - lr * (D_i - mean_j D_j)`` on the complete graph, was about half of the nodes' gap to
    All-Reduce at step 400 on Multi30k En-De (docs/parity.md, section 13); section 17 measures
    ``W`` = the learning rate's warm-up there. A state saved within the warm-up has no exchange in
    flight, so a resume there sends none.

    Only trainable parameters are bucketed, once, at construction: unfreezing one later, or
    :meth:`add_param_group`, needs a new optimizer (``step()`` raises rather than leave such a
    parameter unchanged). Construction broadcasts rank 0's parameters. Without a process group, in
    a single process, it runs as plain AccumAdamW. :meth:`close` (or a ``with`` block) releases the
    exchange groups; :mod:`decentadam.shutdown` does it at exit for optimizers never closed.

    Args:
        params: parameters or parameter groups (as for torch optimizers).
        lr, betas, eps, weight_decay, accum_steps: AccumAdamW hyper-parameters (see
            :class:`decentadam.AccumAdamW`); ``accum_steps > 1`` needs ``second_moment="local"``.
        second_moment: ``"all_ranks"`` (estimate the second moment of the mean gradient over all
            ranks from the rank's own gradients), ``"group_gradient"`` (from the exchange group's
            gradients) or ``"local"`` (each rank's own); see above.
        v_every: with ``second_moment="group_gradient"``, send the gradient every ``v_every``
            (``k``) steps (default 2); not allowed with the others, nor with
            ``intra_node="all_reduce"`` (which gives the estimate every step).
        intra_node: ``"gossip"`` (each rank is a worker of the topology) or ``"all_reduce"``
            (the ranks of a node average their gradients and only nodes gossip; see above).
        exchange: ``"parameters"`` (send the parameters) or ``"bf16_updates"`` (send the update
            from a shared reference point in bfloat16: half the bytes; one fixed group per rank,
            see above).
        share_second_moment_every: with ``intra_node="all_reduce"`` and
            ``second_moment="group_gradient"``, send the node's ``A`` with every k-th exchange and
            lower the floor to ``V / N**2`` (see above); 0 (default): each node keeps its own.
        topology: a name for :func:`decentadam.topology.build` or a built :class:`Topology`.
        local_world_size: ranks per node for node-aware topologies ("aer"); default: the
            ``LOCAL_WORLD_SIZE`` environment variable set by torchrun / accelerate launch, else 1.
        bucket_size_mb: target size of one communication bucket.
        process_group: the ranks that train together (default: the world).
        sync_steps: the first this many steps wait for their exchange and mix at once (a
            synchronous warm-up; see above); 0 (default): every step overlaps.
        overlap: ``"step"`` (exchange overlaps the next forward/backward) or ``"backward"`` (the
            update also overlaps backward; see above).
        foreach: multi-tensor update path (``None``: on CPU and CUDA).
        timeout: seconds to wait for one exchange before raising (a peer died or stalled); ``None``
            leaves it to the process group's timeout, which is the better place with NCCL (where a
            timeout makes every wait block the CPU, torch's ``Work.wait`` semantics).
        hierarchical: on gloo with CPU parameters, sum groups that span several nodes in three
            phases (see :mod:`decentadam.collectives`); ``False``: one flat all-reduce per group.
            Only for the default communicator.
        communicator: replaces the ``torch.distributed`` collectives (tests, instrumentation).
        local_update: replaces the AccumAdamW update of one bucket, ``fn(state, group, params, source)``
            (benchmarks emulate another device's update time with it); default: AccumAdamW's.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_steps: int = 1,
        topology: str | Topology = "aer",
        local_world_size: int | None = None,
        bucket_size_mb: float = 25.0,
        process_group: torch.distributed.ProcessGroup | None = None,
        *,
        second_moment: SecondMoment = "all_ranks",
        v_every: int | None = None,
        intra_node: IntraNode = "gossip",
        exchange: Exchange = "parameters",
        share_second_moment_every: int = 0,
        average_every: int = 0,
        sync_steps: int = 0,
        overlap: Overlap = "step",
        foreach: bool | None = None,
        timeout: float | None = None,
        hierarchical: bool = True,
        communicator: Communicator | None = None,
        local_update: LocalUpdate | None = None,
    ) -> None:
        if second_moment not in SECOND_MOMENTS:
            raise ValueError(
                f"second_moment must be one of {', '.join(map(repr, SECOND_MOMENTS))}, got {second_moment!r}"
            )
        if second_moment != "local" and accum_steps > 1:  # checked at any world size
            raise ValueError(
                f"second_moment={second_moment!r} estimates the second moment of single-step gradients, "
                f"but accum_steps={accum_steps}: use accum_steps=1 with it, or second_moment='local' to "
                "keep AccumAdam's accumulation window"
            )
        if intra_node not in INTRA_NODE:
            raise ValueError(f"intra_node must be 'gossip' or 'all_reduce', got {intra_node!r}")
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be 'parameters' or 'bf16_updates', got {exchange!r}")
        if intra_node == "all_reduce" and second_moment == "group_gradient" and v_every not in (None, 1):
            raise ValueError(
                f"v_every={v_every!r}: with intra_node='all_reduce' the node's gradients give "
                "second_moment='group_gradient' its estimate at every step, with no bytes of its own; "
                "leave v_every out"
            )
        if v_every is not None and second_moment != "group_gradient":
            raise ValueError(
                f"v_every={v_every!r} says how often second_moment='group_gradient' sends the gradient, "
                f"but second_moment={second_moment!r}: pass second_moment='group_gradient' with it, or "
                "leave v_every out"
            )
        share_second_moment_every = _share_every(share_second_moment_every, second_moment, intra_node)
        if not is_count(sync_steps, 0):
            raise ValueError(
                f"sync_steps must be an integer >= 0 (how many first steps wait for their exchange), "
                f"got {sync_steps!r}: use the learning rate's warm-up steps, or 0 (the default)"
            )
        if second_moment == "group_gradient":
            v_every = (1 if intra_node == "all_reduce" else 2) if v_every is None else v_every
            if not is_count(v_every, 1):
                raise ValueError(
                    f"v_every must be an integer >= 1 (send the gradient every v_every steps), got "
                    f"{v_every!r}: use 1 for every step, 2 (the default) for every other step"
                )
        defaults = make_defaults(lr, betas, eps, weight_decay, accum_steps, foreach)
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        if overlap not in ("step", "backward"):
            raise ValueError(f"overlap must be 'step' or 'backward', got {overlap!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        if communicator is not None and not hierarchical:
            raise ValueError(
                "hierarchical=False configures the default communicator, but communicator= was given; "
                "build it as ProcessGroupCommunicator(topology, process_group, hierarchical=False) "
                "instead, or leave communicator= out"
            )
        super().__init__(params, defaults)

        distributed.check_launch_environment()
        if communicator is None and distributed.is_initialized():
            world_size = torch.distributed.get_world_size(process_group)
        else:
            world_size = communicator.world_size if communicator is not None else 1
        if local_world_size is None:
            local_world_size = min(distributed.env_local_world_size(), world_size)
        self.intra_node: IntraNode = intra_node
        node_groups: list[Group] = []
        if intra_node == "all_reduce":
            local_world_size = min(local_world_size, world_size)
            self.topology = over_nodes(topology, world_size, local_world_size)
            size = local_world_size
            node_groups = [tuple(range(first, first + size)) for first in range(0, world_size, size)]
            if second_moment == "group_gradient" and size == 1 and world_size > 1:
                raise ValueError(
                    "second_moment='group_gradient' with intra_node='all_reduce' estimates the second "
                    "moment from the gradients of a node's ranks, but local_world_size is 1: give the "
                    "ranks per node (local_world_size, or LOCAL_WORLD_SIZE from the launcher), or use "
                    "intra_node='gossip'"
                )
        else:
            self.topology = resolve(topology, world_size, local_world_size)
        if not is_count(average_every, 0):
            raise ValueError(
                f"average_every must be an integer >= 0 (every that many steps the exchange is the exact "
                f"average over all ranks; 0: never), got {average_every!r}"
            )
        self.topology = with_global_average(self.topology, average_every)
        # r (bf16_updates) is alike on a rank's one fixed group, or, where groups change, on every
        # rank: it then moves only at the exact averages over all ranks
        self._fixed_groups = changing_groups(self.topology) is None
        if exchange == "bf16_updates":
            _check_fixed_groups(self.topology, intra_node)
        if second_moment == "global" and not has_global_round(self.topology):
            raise ValueError(
                f"second_moment='global' averages the ranks' second moments at the exact averages over "
                f"all ranks, but topology {self.topology.name!r} has none: pass average_every=k (e.g. 16) "
                "or topology='complete'"
            )
        self.exchange: Exchange = exchange
        self.second_moment: SecondMoment = second_moment
        self._v_every = v_every  # k, for second_moment="group_gradient" only
        self.share_second_moment_every: int = share_second_moment_every  # k: the nodes share A; 0: not
        self._set_second_moment()
        self.timeout = NO_TIMEOUT if timeout is None else timedelta(seconds=timeout)
        all_params = [p for group in self.param_groups for p in group["params"]]
        if communicator is None:
            communicator = default_communicator(
                self.topology,
                self.param_groups,
                process_group,
                hierarchical,
                self.timeout or CLOSE_TIMEOUT,
                extra_groups=[g for g in node_groups if len(g) > 1],
            )
        self.communicator = communicator
        self.rank = communicator.rank
        self.world_size = world_size
        self.overlap: Overlap = overlap
        self.sync_steps = sync_steps  # steps 1..sync_steps mix at once (a synchronous warm-up)
        self.stats = CommStats()
        self._local_update: LocalUpdate = local_update if local_update is not None else step_group
        self._step = 0  # t: completed calls of step()
        self._sync_before_next_step = False  # after a resume, exchange x(t) before stepping
        self._buckets = bucketing.make_buckets(self.param_groups, int(bucket_size_mb * 2**20))
        self._gradient_sums: dict[int, _GradientSum] = {}  # id(bucket) -> its gradient exchange
        self._node_sums: dict[int, _NodeSum] = {}  # id(bucket) -> its node's gradient all-reduce
        self._moment_shares: dict[int, _MomentShare] = {}  # id(bucket) -> its nodes' A exchange
        self._node: Group = (self.rank,)
        if intra_node == "all_reduce":
            self._node = next(g for g in node_groups if self.rank in g) if node_groups else (self.rank,)
            if len(self._node) > 1:
                squares = second_moment == "group_gradient"  # only its estimate needs the node's g**2
                self._node_sums = {id(b): _NodeSum.of(b, squares) for b in self._buckets}
            if share_second_moment_every and self.topology.world_size > len(self._node):
                self._moment_shares = {id(b): _MomentShare.of(b) for b in self._buckets}
        elif second_moment == "group_gradient" and world_size > 1:
            sizes = {len(g) for g in self.topology.distinct_groups() if self.rank in g}
            self._gradient_sums = {id(b): _GradientSum.of(b, sizes) for b in self._buckets}
        if second_moment == "global" and world_size > len(self._node):
            self._moment_shares = {id(b): _MomentShare.of(b) for b in self._buckets}
        in_buckets = {id(p) for b in self._buckets for p in b.params}
        self._frozen = [p for p in all_params if id(p) not in in_buckets]
        if world_size > 1:
            bucketing.broadcast(self._buckets, self._frozen, communicator)
        self._updates: dict[int, _UpdateExchange] = {}  # id(bucket) -> its bf16 update exchange
        if exchange == "bf16_updates" and world_size > 1:
            self._updates = {id(b): _UpdateExchange.of(b) for b in self._buckets}
            for bucket in self._buckets:  # r: the broadcast parameters, alike on every rank
                refs = self._updates[id(bucket)]
                with torch.no_grad():
                    torch._foreach_copy_(refs.ref_views, bucket.params)
                for param, view in zip(bucket.params, refs.ref_views, strict=True):
                    self.state[param]["exchange_ref"] = view
        self._backward = BackwardSchedule(self._buckets, self._step_bucket) if overlap == "backward" else None
        self._closed = False
        t = self.topology
        logger.info(
            "DecentralizedAdam: rank %d of %d, topology %s (period %d, spectral gap %.3f), %d buckets",
            *(self.rank, world_size, t.name, t.period, t.spectral_gap(), len(self._buckets)),
        )

    # ------------------------------------------------------------------ the training step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Mix in the neighbours' parameters, take the local AccumAdamW step, start the next exchange."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._closed:
            raise ExchangeGroupsReleased(
                "the exchange groups were released by close(); build a new DecentralizedAdam to train again"
            )
        bucketing.check_no_gradients(self._frozen)
        if self._backward is None:
            self.start_gradient_sums()
        if self._sync_before_next_step:
            for bucket in self._buckets:
                self._start_exchange(bucket, self._step)
            self._sync_before_next_step = False
        pending = self._buckets if self._backward is None else self._backward.pending()
        for bucket in pending:
            self._step_bucket(bucket)
        if self._backward is not None:
            self._backward.end_iteration()
        self._step += 1
        self.stats.steps += 1
        if self._step <= self.sync_steps:  # synchronous warm-up: the next gradient at the mixed point
            for bucket in self._buckets:
                self._mix(bucket)
        return loss

    def _step_bucket(self, bucket: Bucket) -> None:
        self._fold_gradient_sum(bucket)
        self._fold_moment_share(bucket)  # the nodes' mean A, before this step's z joins it
        self._average_node_gradients(bucket)
        self._mix(bucket)
        group = self.param_groups[bucket.group_index]
        self._local_update(self.state, group, [p for p in bucket.params if p.grad is not None], self._source)
        self._start_exchange(bucket, self._step + 1)
        self._start_gradient_sum(bucket, self._step + 1)
        self._start_moment_share(bucket, self._step + 1)

    def _mix(self, bucket: Bucket) -> None:
        """x_i <- sum_j W_ij(t) x_j(t): wait for the group sum and take its mean."""
        if bucket.pending_size <= 1:
            return
        self._wait(bucket)
        updates = self._updates.get(id(bucket))
        # r moves with a rank's one fixed group, or with the exact average over every rank
        moves_ref = self._fixed_groups or bucket.pending_size == self.world_size
        if updates is not None and not updates.whole:  # x_i += S/m - q_i, r += S/m (docstring)
            mean = bucket.buffer.copy_(updates.total).div_(bucket.pending_size)
            if moves_ref:
                updates.ref.add_(mean)
            mean.sub_(updates.own)
            torch._foreach_add_(bucket.params, bucket.views)
        else:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                torch.div(view, bucket.pending_size, out=param)  # one pass: scale while copying
            if updates is not None and moves_ref:  # a whole exchange (resumed without r): r is its mean
                torch._foreach_copy_(updates.ref_views, bucket.params)
                updates.whole = False
        bucket.pending_size = 0

    def _start_exchange(self, bucket: Bucket, step: int) -> None:
        """Send x_i(step) (or its bf16 update from r) to the group of ``step``; the sum arrives in
        ``bucket.buffer`` (or the update exchange's ``total``)."""
        group = self.topology.group_of(self.rank, step)
        bucket.pending_size = len(group)
        if len(group) == 1:
            return
        updates = self._updates.get(id(bucket))
        sent = bucket.buffer
        if updates is not None and not updates.whole:
            for param, ref, own in zip(bucket.params, updates.ref_views, updates.own_views, strict=True):
                torch.sub(param, ref, out=own)  # q_i = bf16(x_i - r): one rounding
            sent = updates.total
            sent.copy_(updates.own)
        else:
            torch._foreach_copy_(bucket.views, bucket.params)
        with self._explain_failure(step, "start"):
            bucket.handle = self.communicator.group_sum(sent, group)
        self.stats.bytes_sent += sent.numel() * sent.element_size()
        self.stats.exchanges += 1

    def _wait(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            self._wait_for(bucket.handle, "parameter", self.timeout)
            bucket.handle = None

    def _wait_for(self, handle: Handle, kind: str, timeout: timedelta) -> None:
        start = time.perf_counter()
        with self._explain_failure(self._step, "finish", kind):  # in flight: the exchange for step t
            handle.wait(timeout)
        self.stats.wait_seconds += time.perf_counter() - start

    def start_gradient_sums(self) -> None:
        """``intra_node="all_reduce"``: start the all-reduce of this step's gradients inside the node.

        :meth:`step` calls it (idempotent until the step); call it yourself to start them earlier,
        and on every simulated rank before any rank's ``step()`` (:mod:`decentadam.simulation`).
        With ``overlap="backward"`` each bucket starts its own when its gradients are final.
        """
        for bucket in self._buckets:
            self._start_node_sum(bucket)

    def _start_node_sum(self, bucket: Bucket) -> None:
        exchange = self._node_sums.get(id(bucket))
        if exchange is None or exchange.started:
            return
        numel = bucket.buffer.numel()
        grads = exchange.buffer[:numel]
        for param, view in zip(bucket.params, views_like(grads, bucket.params), strict=True):
            if param.grad is None:  # unused on this rank: its gradient is 0 (as under DDP)
                view.zero_()
            else:
                view.copy_(param.grad)
        if exchange.buffer.numel() > numel:  # group_gradient: the squares too
            torch.mul(grads, grads, out=exchange.buffer[numel:])
        with self._explain_failure(self._step, "start", "node gradient"):
            exchange.handle = self.communicator.group_sum(exchange.buffer, self._node)
        exchange.started = True
        self.stats.bytes_sent += exchange.buffer.numel() * exchange.buffer.element_size()
        self.stats.exchanges += 1

    def _average_node_gradients(self, bucket: Bucket) -> None:
        """Give every parameter the node's mean gradient; with ``"group_gradient"`` fold ``z`` into A."""
        exchange = self._node_sums.get(id(bucket))
        if exchange is None:
            return
        self._start_node_sum(bucket)  # overlap="backward": from the bucket's gradient hook
        if exchange.handle is not None:
            handle, exchange.handle = exchange.handle, None
            self._wait_for(handle, "node gradient", self.timeout)
        exchange.started = False
        size, numel = len(self._node), bucket.buffer.numel()
        total = exchange.buffer.div_(size)
        mean, mean_sq = total[:numel], total[numel:]
        for param, view in zip(bucket.params, views_like(mean, bucket.params), strict=True):
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)
        if not mean_sq.numel():  # another second moment: only the gradients were summed
            return
        square = mean.square()  # the one temporary: z is built in it, s_L in the received squares
        spread = mean_sq.sub_(square)  # E = sigma^2 (1 - 1/L)
        z = square.sub_(spread.mul_((1.0 / size - 1.0 / self.world_size) / (1.0 - 1.0 / size)))
        decay = self.param_groups[bucket.group_index]["betas"][1]
        for param, z_i in zip(bucket.params, views_like(z, bucket.params), strict=True):
            st = self.state[param]
            if "group_sq" not in st:
                st["group_sq"], st["group_updates"] = torch.zeros_like(param), 0
            st["group_sq"].mul_(decay).add_(z_i, alpha=1.0 - decay)
            st["group_updates"] += 1

    def _start_gradient_sum(self, bucket: Bucket, step: int) -> None:
        """second_moment="group_gradient": every k steps, send g_i (bf16) to the group of ``step``."""
        exchange = self._gradient_sums.get(id(bucket))
        if exchange is None or self._v_every is None or step % self._v_every:
            return
        group = self.topology.group_of(self.rank, step)
        if len(group) == 1:
            return
        for param, view in zip(bucket.params, exchange.own_views, strict=True):
            if param.grad is None:  # unused this step on this rank: its gradient is 0 (as under DDP)
                view.zero_()
            else:
                view.copy_(param.grad)  # rounds to bfloat16
        total = exchange.buffer(len(group))
        total.copy_(exchange.own)
        with self._explain_failure(step, "start", "gradient"):
            exchange.handle = self.communicator.group_sum(total, group)
        exchange.size = len(group)
        self.stats.bytes_sent += total.numel() * total.element_size()

    def _fold_gradient_sum(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Wait for the bucket's gradient sum, if one is pending, and fold its z into A (docstring)."""
        exchange = self._gradient_sums.get(id(bucket))
        if exchange is None:
            return
        q = self._wait_pending(exchange, "gradient", timeout)
        if q <= 1:
            return
        z = _group_gradient_sq(exchange.buffer(q), exchange.own, q, self.world_size)  # (numel,) float32
        assert self._v_every is not None, "a gradient sum needs second_moment='group_gradient'"
        decay = self.param_groups[bucket.group_index]["betas"][1] ** self._v_every
        for param, z_i in zip(bucket.params, views_like(z, bucket.params), strict=True):
            st = self.state[param]
            if "exp_avg" not in st:  # never stepped: no moments for A to go with yet
                continue
            if "group_sq" not in st:
                st["group_sq"], st["group_updates"] = torch.zeros_like(param), 0
            st["group_sq"].mul_(decay).add_(z_i, alpha=1.0 - decay)
            st["group_updates"] += 1

    def _start_moment_share(self, bucket: Bucket, step: int) -> None:
        """``share_second_moment_every=k``: every k steps, send this node's A (bf16) to the nodes of
        the group of ``step``, with the parameters."""
        share = self._moment_shares.get(id(bucket))  # none where k = 0
        if share is None:
            return
        group = self.topology.group_of(self.rank, step)
        if self.second_moment == "global":  # at the exact averages: this rank's all_ranks v
            if len(group) != self.world_size:
                return
            for param, view in zip(bucket.params, share.views, strict=True):
                st = self.state[param]
                if "exp_avg_sq" not in st:  # no gradient yet on this rank: no estimate to give
                    view.zero_()
                else:
                    beta2 = self.param_groups[bucket.group_index]["betas"][1]
                    view.copy_(corrected_second_moment(st, beta2, self._source.noise_ranks))
        elif step % self.share_second_moment_every or len(group) == 1:
            return
        else:
            for param, view in zip(bucket.params, share.views, strict=True):
                # every parameter has A: the node's sum gave it a gradient and z before this update
                view.copy_(self.state[param]["group_sq"])  # rounds to bfloat16
        with self._explain_failure(step, "start", "second moment"):
            share.handle = self.communicator.group_sum(share.total, group)
        share.size = len(group)
        self.stats.bytes_sent += share.total.numel() * share.total.element_size()

    def _fold_moment_share(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Wait for the bucket's A sum, if one is pending, and replace A by the group's mean."""
        share = self._moment_shares.get(id(bucket))
        if share is None:
            return
        q = self._wait_pending(share, "second moment", timeout)
        if q <= 1:
            return
        key = "shared_sq" if self.second_moment == "global" else "group_sq"
        for param, total in zip(bucket.params, share.views, strict=True):
            st = self.state[param]
            if key not in st:
                st[key] = torch.empty_like(param)
            st[key].copy_(total).div_(q)

    def _wait_pending(
        self, exchange: _GradientSum | _MomentShare, kind: str, timeout: timedelta | None
    ) -> int:
        """Wait for ``exchange``'s sum if one is pending and mark it taken: its group's size q (0 or
        1: nothing pending)."""
        q, exchange.size = exchange.size, 0
        if q > 1 and exchange.handle is not None:
            handle, exchange.handle = exchange.handle, None
            self._wait_for(handle, kind, self.timeout if timeout is None else timeout)
        return q

    def _fold_in_flight(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Fold the second-moment sums in flight into the state (parameters wait for the step)."""
        self._fold_gradient_sum(bucket, timeout)
        self._fold_moment_share(bucket, timeout)

    @contextlib.contextmanager
    def _explain_failure(self, step: int, what: str, kind: str = "parameter") -> Iterator[None]:
        """Re-raise a failed collective with what it was for and what probably happened."""
        try:
            yield
        except ExchangeGroupsReleased:
            raise
        except RuntimeError as error:
            limit = f"{self.timeout.total_seconds():g} s" if self.timeout else "the process group's timeout"
            raise RuntimeError(
                f"rank {self.rank}: the {kind} exchange for step {step} with ranks "
                f"{self.topology.group_of(self.rank, step)} did not {what} "
                f"(waited at most {limit}); a peer process probably died or stalled. Check the other "
                f"ranks' logs. Cause: {error}"
            ) from error

    def _set_second_moment(self) -> None:
        """The update's second moment (:class:`~decentadam.optim.accum_adamw.MomentSource`): ``n``
        from ``second_moment`` and the world size, with ``"group_gradient"`` its ``v_every``, which
        makes the update use ``A``. The param groups carry none of it (keys of older states go)."""
        corrected = self.second_moment != "local"
        noise_ranks = self.topology.world_size // self._ranks_per_worker() if corrected else 1
        for group in self.param_groups:
            for key in LEGACY_GROUP_KEYS:
                group.pop(key, None)
            if corrected and group["accum_steps"] > 1:  # checked at any world size
                raise ValueError(
                    f"second_moment={self.second_moment!r} needs accum_steps=1, but a param group has "
                    f"accum_steps={group['accum_steps']}: drop it from the group or use second_moment='local'"
                )
        self._source = MomentSource(
            noise_ranks=noise_ranks,
            # the nodes' mean A may ask a node for N times its own step (class docstring)
            floor_ranks=noise_ranks * noise_ranks if self.share_second_moment_every else None,
            estimate_every=self._v_every,
            shared=self.second_moment == "global",
        )

    def _ranks_per_worker(self) -> int:
        """With ``intra_node="all_reduce"`` a node's L ranks act as one (their mean has 1/L the noise)."""
        return self.topology.local_world_size if self.intra_node == "all_reduce" else 1

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group while the optimizer is built; afterwards this raises (the buckets are fixed)."""
        if hasattr(self, "_buckets"):
            raise RuntimeError(
                "DecentralizedAdam: add_param_group() after construction is not supported: parameters "
                "are packed into communication buckets once, at construction, so the new group would "
                "be neither updated nor averaged. Build a new DecentralizedAdam with every group "
                "(carry the state over with state_dict() and load_state_dict())."
            )
        super().add_param_group(param_group)
        check_group(self.param_groups[-1])

    def remove_hooks(self) -> None:
        """Detach the backward-mode hooks (the optimizer then behaves as ``overlap="step"``).

        Call it after :meth:`step`: between ``backward()`` and ``step()`` the hooks may already have
        updated some buckets of this iteration, and it raises.
        """
        if self._backward is not None:
            self._backward.remove()
            self._backward = None
        self.overlap = "step"

    # ------------------------------------------------------------------ consensus

    def average_parameters(self, restore: bool = True) -> AveragedParameters:
        """Set every rank's parameters to the exact average over all ranks (a collective).

        ``with opt.average_parameters(): evaluate(model)`` evaluates the consensus model and puts
        each rank's local parameters back on exit; ``restore=False`` keeps the average (a final model).
        """
        self.wait_for_exchanges()
        return bucketing.average(self._buckets, self.communicator, restore)

    def consensus_distance(self, relative: bool = False) -> float:
        """mean_i ||x_i - x_bar||^2 over all ranks and parameters (a collective; float64 sums).

        ``relative=True`` divides by ``||x_bar||^2``: the health metric, which should stay well below 1.
        """
        distance, mean_norm = self.consensus_stats()
        if not relative:
            return distance
        return distance / mean_norm if mean_norm > 0 else 0.0

    def consensus_stats(self) -> tuple[float, float]:
        """(mean_i ||x_i - x_bar||^2, ||x_bar||^2): one all-reduce of a float64 copy of the parameters."""
        self.wait_for_exchanges()
        return bucketing.consensus_stats(self._buckets, self.communicator, self.device)

    def wait_for_exchanges(self) -> None:
        """Block until the exchanges in flight have arrived; they are mixed in at the next step.

        ``step()`` returns with an exchange in flight; call this to time an iteration with its
        communication (averaging, checkpoints and :meth:`close` wait by themselves).
        """
        if self._backward is not None and self._backward.in_backward:
            raise RuntimeError(
                "DecentralizedAdam(overlap='backward'): waiting for exchanges (averaging, consensus, "
                "checkpoints) between backward() and step() is not supported; call it after step()"
            )
        for bucket in self._buckets:
            self._wait(bucket)
            self._fold_in_flight(bucket)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for the exchanges in flight, detach the hooks and release the exchange groups.

        Call it on every rank when training ends, before ``dist.destroy_process_group()`` or
        ``accelerator.end_training()``; ``with DecentralizedAdam(...) as optimizer:`` calls it on exit.
        Idempotent. Parameters and state stay readable (a gradient sum in flight is folded into the
        state first); a later :meth:`step` raises :class:`~decentadam.collectives.ExchangeGroupsReleased`.
        """
        self._closed = True
        if self._backward is not None:
            self._backward.detach()
            self._backward = None
        try:
            for bucket in self._buckets:
                self._fold_in_flight(bucket, self.timeout or CLOSE_TIMEOUT)
        except RuntimeError as error:  # a peer died: the state keeps A without the last sum
            logger.warning("decentadam: a second-moment sum in flight at close did not finish: %s", error)
            for exchange in self._gradient_sums.values():
                exchange.handle, exchange.size = None, 0
            for share in self._moment_shares.values():
                share.handle, share.size = None, 0
        if isinstance(self.communicator, Closable):
            self.communicator.close()
        for bucket in self._buckets:  # a finished exchange's handle still holds its group's gloo context
            bucket.handle = None

    def __enter__(self) -> DecentralizedAdam:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def _load_references(self, same_groups: bool) -> None:
        """After loading state: copy each parameter's ``exchange_ref`` into its bucket's flat r. Where
        the loaded state has none (saved with exchange="parameters"), or was saved with other groups
        (``same_groups`` false: their r need not be alike on the new group), the next exchange sends
        the whole parameters and r becomes their mean."""
        for bucket in self._buckets:
            updates = self._updates.get(id(bucket))
            if updates is None:
                continue
            loaded = [self.state[p].get("exchange_ref") for p in bucket.params]
            updates.whole = not same_groups or any(ref is None for ref in loaded)
            for param, view, ref in zip(bucket.params, updates.ref_views, loaded, strict=True):
                if ref is not None and ref is not view:
                    view.copy_(ref)
                self.state[param]["exchange_ref"] = view

    @property
    def moment_source(self) -> MomentSource:
        """The second moment the AccumAdamW update divides by (from ``second_moment``, the world size
        and the nodes), passed to each bucket's update."""
        return self._source

    @property
    def step_count(self) -> int:
        """t: how many times step() has completed (the topology round of the next step is t % period)."""
        return self._step

    @property
    def device(self) -> torch.device:
        """Where the parameters (and the communication buffers) live."""
        return self._buckets[0].buffer.device if self._buckets else torch.device("cpu")

    @property
    def buckets(self) -> Sequence[Bucket]:
        """The communication buckets, in exchange order (read them; do not modify)."""
        return tuple(self._buckets)

    def state_dict(self) -> dict[str, Any]:
        """The AccumAdamW state of this rank plus the decentralized step counter and topology (with
        ``second_moment="group_gradient"``, a gradient sum in flight is waited for and folded in)."""
        for bucket in self._buckets:
            self._fold_in_flight(bucket)
        state = super().state_dict()
        state["decentralized"] = {
            "step": self._step,
            "second_moment": self.second_moment,
            "v_every": self._v_every,
            "share_second_moment_every": self.share_second_moment_every,
            "sync_steps": self.sync_steps,
            **self._groups_layout(),
        }
        return state

    def _same_groups(self, extra: dict[str, Any]) -> bool:
        """Whether a state's saved layout is this optimizer's (keys that older states lack count as
        the defaults they were saved with)."""
        saved = {"local_world_size": None, "intra_node": "gossip", "exchange": "parameters", **extra}
        return all(saved.get(key) == value for key, value in self._groups_layout().items())

    def _groups_layout(self) -> dict[str, Any]:
        """What decides the groups a rank exchanges with, and so whom ``exchange="bf16_updates"``'s
        r is shared with (saved in the state; a state whose layout differs resumes without its r)."""
        return {
            "topology": self.topology.name,
            "world_size": self.world_size,
            "local_world_size": self.topology.local_world_size,
            "intra_node": self.intra_node,
            "exchange": self.exchange,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's state; the next step first exchanges the (possibly diverse) parameters."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("decentralized", None)
        for bucket in self._buckets:  # a sum in flight belongs to the state being replaced
            self._fold_in_flight(bucket)
        super().load_state_dict(state_dict)
        self._set_second_moment()  # the saved groups' values may be another world size's, or missing
        if extra is not None:
            if extra["world_size"] != self.world_size or extra["topology"] != self.topology.name:
                saved, now = (extra["topology"], extra["world_size"]), (self.topology.name, self.world_size)
                logger.warning(
                    "optimizer state was saved with topology %s on %d ranks; continuing with %s on %d",
                    *saved,
                    *now,
                )
            saved_moment = (
                extra.get("second_moment"),
                extra.get("v_every"),
                extra.get("intra_node", "gossip"),
                extra.get("share_second_moment_every", 0),
            )
            now_moment = (self.second_moment, self._v_every, self.intra_node, self.share_second_moment_every)
            if saved_moment != now_moment:
                logger.warning(
                    "optimizer state was saved with second_moment=%r, v_every=%r, intra_node=%r, "
                    "share_second_moment_every=%r; continuing with %r, %r, %r, %r (the second moment's "
                    "state is kept where both use it)",
                    *saved_moment,
                    *now_moment,
                )
            if extra.get("exchange", "parameters") != self.exchange:
                logger.warning(
                    "optimizer state was saved with exchange=%r; continuing with %r",
                    extra.get("exchange", "parameters"),
                    self.exchange,
                )
            self._step = int(extra["step"])
        saved_sync_steps = int(extra.get("sync_steps", 0)) if extra is not None else self.sync_steps
        self.wait_for_exchanges()
        # r is shared by the group the state was saved in: another layout of groups, or no r, takes
        # one exchange of the whole parameters instead (then r is their mean)
        self._load_references(extra is not None and self._same_groups(extra))
        for bucket in self._buckets:
            bucket.pending_size = 0
        # Step 0 does not mix (construction made every rank equal), so a state saved before the first
        # step (or reloaded in place, as Accelerate's device placement does) needs no exchange; nor
        # does one saved within its synchronous warm-up (the sync_steps it was saved with), whose
        # steps mixed before returning.
        self._sync_before_next_step = self.world_size > 1 and self._step > saved_sync_steps
        # Backward mode: hooks would step the buckets before step() can exchange x(t); run the next
        # iteration from step() (it also recounts the hooks).
        if self._backward is not None:
            self._backward.recount()


def _check_fixed_groups(topology: Topology, intra_node: IntraNode) -> None:
    """exchange="bf16_updates": every rank averages with one fixed group (its r is that group's), or
    the groups change and some steps average every rank exactly (r is then every rank's, and moves
    only at those steps)."""
    found = changing_groups(topology)
    if found is not None and not has_global_round(topology):
        rank, groups = found
        where = "over the nodes " if intra_node == "all_reduce" else ""
        raise ValueError(
            f"exchange='bf16_updates' sends updates from a reference point that a rank shares "
            f"with every rank it averages with, but topology {topology.name!r} {where}gives rank {rank} "
            f"{len(groups)} different groups ({groups}) and never averages all ranks, where that "
            "point would be renewed: pass average_every=k (e.g. 16), use topology='complete', or "
            "exchange='parameters'"
        )


@dataclass(eq=False)
class _UpdateExchange:
    """One bucket's ``exchange="bf16_updates"`` buffers: r, and the update sent and summed."""

    ref: Tensor  # (numel,) in the parameters' dtype: r, the reference point alike on the group
    ref_views: list[Tensor]  # views of ``ref`` shaped like the bucket's parameters (their state)
    own: Tensor  # (numel,) bfloat16: q_i = bf16(x_i - r), as sent
    own_views: list[Tensor]  # views of ``own`` shaped like the bucket's parameters
    total: Tensor  # (numel,) bfloat16: q_i sent, the group's sum S received
    whole: bool = False  # the next exchange sends the parameters (r was not in a loaded state)

    @classmethod
    def of(cls, bucket: Bucket) -> _UpdateExchange:
        flat = bucket.buffer
        ref = torch.empty_like(flat)
        own = torch.empty(flat.numel(), dtype=torch.bfloat16, device=flat.device)
        params = bucket.params
        return cls(ref, views_like(ref, params), own, views_like(own, params), torch.empty_like(own))


@dataclass(eq=False)
class _NodeSum:
    """One bucket's all-reduce of ``intra_node="all_reduce"``: its gradients, then (for
    ``second_moment="group_gradient"``) their squares."""

    buffer: Tensor  # (numel or 2 numel,) in the parameters' dtype: g_i (and g_i**2) sent, sums received
    handle: Handle | None = None  # the sum in flight
    started: bool = False  # started for this step, not yet averaged into the gradients

    @classmethod
    def of(cls, bucket: Bucket, squares: bool) -> _NodeSum:
        flat = bucket.buffer
        size = (2 if squares else 1) * flat.numel()
        return cls(torch.empty(size, dtype=flat.dtype, device=flat.device))


@dataclass(eq=False)
class _GradientSum:
    """One bucket's gradient exchange of ``second_moment="group_gradient"``."""

    own: Tensor  # (numel,) bfloat16: this rank's gradient as sent, g_i
    own_views: list[Tensor]  # views of ``own`` shaped like the bucket's parameters
    pair: Tensor | None  # (numel,) bfloat16: ``own`` sent to a group of 2, their sum received
    wide: Tensor | None  # (numel,) float32: ``own`` sent to a larger group, its sum received
    handle: Handle | None = None  # the sum in flight
    size: int = 0  # q > 1: ``buffer(q)`` holds (or will hold) the sum over a group of q ranks

    @classmethod
    def of(cls, bucket: Bucket, sizes: set[int]) -> _GradientSum:
        """Buffers for the sizes (> 1) of the groups this rank exchanges with."""
        device, numel = bucket.buffer.device, bucket.buffer.numel()
        own = torch.empty(numel, dtype=torch.bfloat16, device=device)
        pair = torch.empty(numel, dtype=torch.bfloat16, device=device) if 2 in sizes else None
        wide = torch.empty(numel, dtype=torch.float32, device=device) if max(sizes, default=0) > 2 else None
        return cls(own, views_like(own, bucket.params), pair, wide)

    def buffer(self, q: int) -> Tensor:
        """The send buffer of a group of ``q > 1`` ranks (docstring of DecentralizedAdam)."""
        total = self.pair if q == 2 else self.wide
        assert total is not None, f"no gradient buffer for a group of {q} ranks"
        return total


@dataclass(eq=False)
class _MomentShare:
    """One bucket's exchange of ``share_second_moment_every``: the node's ``A`` in bfloat16."""

    total: Tensor  # (numel,) bfloat16: this node's A sent, the group's sum received in place
    views: list[Tensor]  # views of ``total`` shaped like the bucket's parameters
    handle: Handle | None = None  # the sum in flight
    size: int = 0  # q > 1: ``total`` holds (or will hold) the sum over a group of q ranks

    @classmethod
    def of(cls, bucket: Bucket) -> _MomentShare:
        total = torch.empty(bucket.buffer.numel(), dtype=torch.bfloat16, device=bucket.buffer.device)
        return cls(total, views_like(total, bucket.params))


def _share_every(every: object, second_moment: str, intra_node: str) -> int:
    """``share_second_moment_every`` checked: 0 (never) anywhere; ``k >= 1`` needs the nodes'
    ``group_gradient`` estimate."""
    applies = intra_node == "all_reduce" and second_moment == "group_gradient"
    if not is_count(every, 0):
        raise ValueError(
            f"share_second_moment_every must be an integer >= 0 (send the node's second moment every "
            f"that many steps; 0: never), got {every!r}: use 2 (1 byte per parameter and step), or "
            "0 (the default)"
        )
    if every and not applies:
        raise ValueError(
            f"share_second_moment_every={every} shares the nodes' second_moment='group_gradient' "
            f"estimate, but second_moment={second_moment!r}, intra_node={intra_node!r}: pass "
            "intra_node='all_reduce', second_moment='group_gradient' with it, or leave it out"
        )
    return every


def _group_gradient_sq(total: Tensor, own: Tensor, q: int, n: int) -> Tensor:
    """``z = gbar**2 - (g_i**2 - gbar**2) (1/q - 1/n) / (1 - 1/q)`` with ``gbar = total / q`` (in
    place in a float32 ``total``; a bfloat16 one, a pair's, is read into a new float32 tensor), in
    float32."""
    mean = total.div_(q) if total.dtype == torch.float32 else total.float().div_(q)
    mean_sq = mean.square()
    share = (1.0 / q - 1.0 / n) / (1.0 - 1.0 / q)
    spread = own.to(torch.float32, copy=True).square_().sub_(mean_sq).mul_(share)  # the one other temporary
    return mean_sq.sub_(spread)
