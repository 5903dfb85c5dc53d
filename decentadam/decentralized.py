"""DecentralizedAdam: local AccumAdamW steps plus neighbour averaging that overlaps compute."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.optim import Optimizer

from decentadam import buckets as bucketing
from decentadam import distributed, optimizer_state
from decentadam.backward import BackwardSchedule
from decentadam.buckets import AveragedParameters, Bucket
from decentadam.collectives import (
    CLOSE_TIMEOUT,
    NO_TIMEOUT,
    Closable,
    CommStats,
    ExchangeGroupsReleased,
    default_communicator,
)
from decentadam.exchanges import Exchange
from decentadam.exchanges.group_gradient import GroupGradients
from decentadam.exchanges.link import Link
from decentadam.exchanges.moments import MomentShares
from decentadam.exchanges.node_gradients import NodeGradients
from decentadam.exchanges.parameters import ParameterExchange
from decentadam.optim.accum_adamw import MomentSource, ParamsT, check_group, make_defaults, step_group
from decentadam.options import Comm, Global, Local, LocalUpdate, Setting, make_setting
from decentadam.topology import Group

__all__ = ["CommStats", "DecentralizedAdam"]

logger = logging.getLogger(__name__)


class DecentralizedAdam(Optimizer):
    r"""Decentralized AccumAdamW: each rank keeps its own parameters and averages with neighbours.

    For the ``t``-th call of :meth:`step` (``t = 0, 1, 2, ...``), on rank ``i``::

        x_i(t+1) = (1 - lr * weight_decay) * sum_j W_ij(t) x_j(t) - lr * D_i(t)

    where ``W(t) = topology.mixing_matrix(t)`` (rank ``i`` averages uniformly with the other members
    of its group at step ``t``) and ``D_i(t)`` is rank ``i``'s AccumAdamW direction from its own
    gradient, computed at ``x_i(t)``: the decoupled weight decay applies to the mixed parameters, as
    the update runs right after the mixing. The Adam moments stay on the rank; which second moment
    ``D`` divides by, whom a rank averages with and what it sends is the ``setting``
    (:class:`~decentadam.options.Setting`, or a name of :data:`~decentadam.options.SETTINGS`:
    ``docs/choosing.md`` says which to use). A rank's gradient comes from a ``1/n`` share of the
    global batch, so its own second moment holds ``n`` times the noise variance of the mean
    gradient that All-Reduce's Adam divides by; the default estimates the mean gradient's
    (:class:`~decentadam.options.AllRanks`, :class:`~decentadam.AccumAdamW`'s ``noise_ranks``).

    Each step, for each bucket of parameters (:mod:`decentadam.buckets`): finish what the last step
    sent (second moments, the node's gradients, then the parameters: the mixing), take the
    AccumAdamW update, and start the exchanges of step ``t+1``, which travel during the next
    forward/backward (:mod:`decentadam.exchanges`, one module per kind). ``Comm(overlap="backward")``
    also steps each bucket from gradient hooks once its gradients are final
    (:mod:`decentadam.backward`).

    A synchronous warm-up (``Setting(sync_steps=W)``): the first ``W`` steps wait for their exchange
    right after the update and mix at once, so every rank takes its next gradient at the mixed point
    (on the complete graph, the ranks' mean); later steps overlap. The bytes and the arithmetic are
    the same; only ``W`` exchanges no longer hide behind compute. A state saved within the warm-up
    has no exchange in flight, so a resume there sends none.

    Only trainable parameters are bucketed, once, at construction: unfreezing one later, or
    :meth:`add_param_group`, needs a new optimizer (``step()`` raises rather than leave such a
    parameter unchanged). Construction broadcasts rank 0's parameters. Without a process group, in
    a single process, it runs as plain AccumAdamW. :meth:`close` (or a ``with`` block) releases the
    exchange groups; :mod:`decentadam.shutdown` does it at exit for optimizers never closed.
    State: :mod:`decentadam.optimizer_state`.

    Args:
        params: parameters or parameter groups (as for torch optimizers).
        lr, betas, eps, weight_decay: AccumAdamW hyper-parameters (:class:`decentadam.AccumAdamW`).
        setting: a name of :data:`~decentadam.options.SETTINGS` or a
            :class:`~decentadam.options.Setting` (default: ``"default"``).
        accum_steps: the AccumAdam window (:class:`~decentadam.options.Local`); given without a
            ``setting``, ``accum_steps > 1`` selects ``"accumadam"`` with this window
            (:func:`~decentadam.options.make_setting`).
        comm: how the ranks are laid out and talk (:class:`~decentadam.options.Comm`: ranks per node,
            process group, buckets, overlap, timeout, communicator).
        foreach: multi-tensor update path (``None``: on CPU and CUDA).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        setting: Setting | str | None = None,
        accum_steps: int | None = None,
        comm: Comm | None = None,
        foreach: bool | None = None,
    ) -> None:
        self.setting = make_setting(setting, accum_steps=accum_steps)
        if comm is not None and not isinstance(comm, Comm):
            raise TypeError(f"comm must be a decentadam.options.Comm, got {comm!r}")
        self.comm = comm = comm or Comm()
        defaults = make_defaults(lr, betas, eps, weight_decay, self.setting.accum_steps, foreach)
        super().__init__(params, defaults)

        distributed.check_launch_environment()
        communicator = comm.communicator
        if communicator is None and distributed.is_initialized():
            world_size = torch.distributed.get_world_size(comm.process_group)
        else:
            world_size = communicator.world_size if communicator is not None else 1
        local_world_size = comm.local_world_size
        if local_world_size is None:
            local_world_size = min(distributed.env_local_world_size(), world_size)
        self.topology = self.setting.schedule(world_size, local_world_size)
        nodes = self.setting.intra_node == "all_reduce"
        size = self.topology.local_world_size
        node_groups = (
            [tuple(range(first, first + size)) for first in range(0, world_size, size)] if nodes else []
        )
        self._set_second_moment()
        self.timeout = NO_TIMEOUT if comm.timeout is None else timedelta(seconds=comm.timeout)
        if communicator is None:
            communicator = default_communicator(
                self.topology,
                self.param_groups,
                comm.process_group,
                comm.hierarchical,
                self.timeout or CLOSE_TIMEOUT,
                extra_groups=[g for g in node_groups if len(g) > 1],
            )
        self.communicator = communicator
        self.rank = communicator.rank
        self.world_size = world_size
        self.overlap = comm.overlap
        self.stats = CommStats()
        self._local_update: LocalUpdate = comm.local_update or step_group
        self._step = 0  # t: completed calls of step()
        self._sync_before_next_step = False  # after a resume, exchange x(t) before stepping
        self._buckets = bucketing.make_buckets(self.param_groups, int(comm.bucket_size_mb * 2**20))
        link = Link(communicator, self.topology, self.rank, world_size, self.timeout, self.stats, self._clock)
        self._node: Group = next((g for g in node_groups if self.rank in g), (self.rank,))
        self._make_second_moment_exchanges(link)
        all_params = [p for group in self.param_groups for p in group["params"]]
        in_buckets = {id(p) for b in self._buckets for p in b.params}
        self._frozen = [p for p in all_params if id(p) not in in_buckets]
        if world_size > 1:
            bucketing.broadcast(self._buckets, self._frozen, communicator)
        self._parameters = ParameterExchange(link, self._buckets, self.setting.exchange == "bf16_updates")
        self._parameters.init_references(self._buckets, self.state)
        # at a step: the second moments (before this step's z joins them), the node's gradients, then
        # the parameters are finished; after the update the parameters and second moments start
        second_moments: list[Exchange] = [e for e in (self._gradient_sums, self._moments) if e is not None]
        node: list[Exchange] = [self._node_gradients] if self._node_gradients is not None else []
        self._arriving: list[Exchange] = [*second_moments, *node, self._parameters]
        self._departing: list[Exchange] = [self._parameters, *second_moments]
        self._in_state: list[Exchange] = second_moments  # what settle() folds into the state
        self._backward = (
            BackwardSchedule(self._buckets, self._step_bucket) if comm.overlap == "backward" else None
        )
        self._closed = False
        t = self.topology
        logger.info(
            "DecentralizedAdam: rank %d of %d, topology %s (period %d, spectral gap %.3f), %d buckets",
            *(self.rank, world_size, t.name, t.period, t.spectral_gap(), len(self._buckets)),
        )

    def _make_second_moment_exchanges(self, link: Link) -> None:
        """The node's gradient sums, the group's gradient sums and the shared second moments this
        setting uses on this job (None where it uses none, or where a group of one sends nothing)."""
        nodes, v_every = self.setting.intra_node == "all_reduce", self.setting.v_every
        self._node_gradients: NodeGradients | None = None
        self._gradient_sums: GroupGradients | None = None
        self._moments: MomentShares | None = None
        if nodes and len(self._node) > 1:
            squares = v_every is not None  # only the group_gradient estimate needs the node's g**2
            self._node_gradients = NodeGradients(link, self, self._buckets, self._node, squares)
        elif not nodes and v_every is not None and self.world_size > 1:
            self._gradient_sums = GroupGradients(link, self, self._buckets, v_every)
        share_every = self.setting.share_every if nodes else 0
        if isinstance(self.setting.second_moment, Global) and self.world_size > len(self._node):
            floored = self.setting.second_moment.floored
            self._moments = MomentShares(link, self, self._buckets, 0, self._source.noise_ranks, floored)
        elif share_every and self.topology.world_size > len(self._node):
            self._moments = MomentShares(link, self, self._buckets, share_every, None)

    def _clock(self) -> int:
        """t, for the exchanges' errors: the step whose exchange is waited for."""
        return self._step

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
                self._parameters.start(bucket, self._step)
            self._sync_before_next_step = False
        pending = self._buckets if self._backward is None else self._backward.pending()
        for bucket in pending:
            self._step_bucket(bucket)
        if self._backward is not None:
            self._backward.end_iteration()
        self._step += 1
        self.stats.steps += 1
        if self._step <= self.setting.sync_steps:  # synchronous warm-up: the next gradient at the mixed point
            for bucket in self._buckets:
                self._parameters.finish(bucket)
        return loss

    def _step_bucket(self, bucket: Bucket) -> None:
        for exchange in self._arriving:
            exchange.finish(bucket)
        group = self.param_groups[bucket.group_index]
        self._local_update(self.state, group, [p for p in bucket.params if p.grad is not None], self._source)
        for exchange in self._departing:
            exchange.start(bucket, self._step + 1)

    def start_gradient_sums(self) -> None:
        """``intra_node="all_reduce"``: start the all-reduce of this step's gradients inside the node.

        :meth:`step` calls it (idempotent until the step); call it yourself to start them earlier,
        and on every simulated rank before any rank's ``step()`` (:mod:`decentadam.simulation`).
        With ``overlap="backward"`` each bucket starts its own when its gradients are final.
        """
        if self._node_gradients is not None:
            for bucket in self._buckets:
                self._node_gradients.start(bucket, self._step)

    def _set_second_moment(self) -> None:
        """The update's second moment (:meth:`~decentadam.options.Setting.moment_source`); the param
        groups carry none of it (the keys of older states go)."""
        self._source = self.setting.moment_source(self.topology)
        corrected = not isinstance(self.setting.second_moment, Local)
        for group in self.param_groups:
            for key in optimizer_state.LEGACY_GROUP_KEYS:
                group.pop(key, None)
            if corrected and group["accum_steps"] > 1:  # checked at any world size
                raise ValueError(
                    f"second_moment={self.setting.second_moment.name!r} needs accum_steps=1, but a param "
                    f"group has accum_steps={group['accum_steps']}: drop it from the group or use "
                    "second_moment='local'"
                )

    @property
    def moment_source(self) -> MomentSource:
        """The second moment the AccumAdamW update divides by (from the setting, the world size and
        the nodes), passed to each bucket's update."""
        return self._source

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
                "Comm(overlap='backward'): waiting for exchanges (averaging, consensus, "
                "checkpoints) between backward() and step() is not supported; call it after step()"
            )
        for bucket in self._buckets:
            self._parameters.settle(bucket)
            self._settle_state(bucket)

    def _settle_state(self, bucket: Bucket, timeout: timedelta | None = None) -> None:
        """Fold the second-moment sums in flight into the state (parameters wait for the step)."""
        for exchange in self._in_state:
            exchange.settle(bucket, timeout)

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
                self._settle_state(bucket, self.timeout or CLOSE_TIMEOUT)
        except RuntimeError as error:  # a peer died: the state keeps its second moments without the last sum
            logger.warning("decentadam: a second-moment sum in flight at close did not finish: %s", error)
            for exchange in self._in_state:
                exchange.abandon()
        if isinstance(self.communicator, Closable):
            self.communicator.close()
        for bucket in self._buckets:  # a finished exchange's handle still holds its group's gloo context
            bucket.handle = None

    def __enter__(self) -> DecentralizedAdam:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

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
        """This rank's AccumAdamW state plus the ``"decentralized"`` entry
        (:mod:`decentadam.optimizer_state`); a second-moment sum in flight is folded in first."""
        for bucket in self._buckets:
            self._settle_state(bucket)
        state = super().state_dict()
        state["decentralized"] = optimizer_state.entry(
            self._step, self.setting, self.topology, self.world_size
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's state; the next step first exchanges the (possibly diverse) parameters."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("decentralized", None)
        for bucket in self._buckets:  # a sum in flight belongs to the state being replaced
            self._settle_state(bucket)
        super().load_state_dict(state_dict)
        self._set_second_moment()  # the loaded groups may carry older versions' keys
        loaded = optimizer_state.read(extra, self.setting, self.topology, self.world_size)
        if loaded.step is not None:
            self._step = loaded.step
        self.wait_for_exchanges()
        # r is shared by the group the state was saved in: another layout of groups, or no r, takes
        # one exchange of the whole parameters instead (then r is their mean)
        self._parameters.load_references(self._buckets, self.state, loaded.same_groups)
        for bucket in self._buckets:
            bucket.pending_size = 0
        # Step 0 does not mix (construction made every rank equal), so a state saved before the first
        # step (or reloaded in place, as Accelerate's device placement does) needs no exchange; nor
        # does one saved within its synchronous warm-up (the sync_steps it was saved with), whose
        # steps mixed before returning.
        saved_sync = self.setting.sync_steps if loaded.sync_steps is None else loaded.sync_steps
        self._sync_before_next_step = self.world_size > 1 and self._step > saved_sync
        # Backward mode: hooks would step the buckets before step() can exchange x(t); run the next
        # iteration from step() (it also recounts the hooks).
        if self._backward is not None:
            self._backward.recount()
