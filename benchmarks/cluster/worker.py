"""One rank of the cluster benchmark (started by ``benchmarks.cluster.run`` inside its node's namespace).

    python -m benchmarks.cluster.worker '<json of WorkerSpec>'   # with RANK, WORLD_SIZE, MASTER_ADDR, ...

The model is ``layers`` parameter tensors of ``param_bytes / layers`` bytes each. Compute is
emulated: layer k's forward sleeps ``f C / layers`` and its backward sleeps ``(1-f) C / layers``
before handing out the gradient of its parameter, so gradients become ready one after the other
during backward exactly as in a real network: DDP's buckets fire (and all-reduce) during backward,
and sleeping leaves the 2 CPU cores free for the communication threads and for the other ranks.
Gradients are fixed random tensors (copied into ``.grad`` by autograd each iteration); everything
after backward (DDP's reduction, the mixing, the buffer copies) is the real code doing real work.

The optimizer arithmetic is device work too. With ``update_ms_per_mb > 0`` it is emulated like the
compute: torch AdamW, decentadam's AccumAdamW update and decent-dp's AccumAdamW are each replaced by
a sleep of that many milliseconds per MB of the parameters they update (what a GPU takes), while
DecentralizedAdam's mixing and send-buffer copies, decent-dp's mixing and copies, and DDP's gradient
buckets stay real. With 0 they run for real on the CPU, where 8 ranks' steps on 2 cores cost far
more than on 8 devices.

Methods: ``allreduce`` (torch DDP, gloo, bucket_cap_mb, torch.optim.AdamW(foreach)), ``ours``
(decentadam.DecentralizedAdam), ``decent-dp`` (decent_dp 0.2.3's DecentralizedDataParallel with its
AccumAdamW), ``exchange`` (DecentralizedAdam's exchanges alone: the topology's group sums of the
bucketed parameters, step after step, with no compute and no update; what the network and the
communicator cost on their own) and ``calibrate`` (no network: times the optimizer steps of all
ranks at once, the runtime model's update-time inputs).

Rank 0 also reads the whole machine's CPU counters (``/proc/stat``, not namespaced) around the
measured iterations: the share of the cores that was busy while the configuration ran.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.gossip import plain
from decentadam import DecentralizedAdam
from decentadam.collectives import Handle
from decentadam.options import Comm, Local, LocalUpdate
from decentadam.topology import Group

LR = 1e-4


@dataclass
class WorkerSpec:
    """What every rank runs (the same on all ranks)."""

    method: str
    """allreduce | ours | decent-dp | exchange | calibrate."""
    out: str
    """Rank 0 writes the JSON result here."""
    topology: str = "aer"
    """Topology name (ours: decentadam names; decent-dp: its names)."""
    param_bytes: int = 100_000_000
    layers: int = 8
    compute_ms: float = 100.0
    forward_fraction: float = 1.0 / 3.0
    straggler_rank: int = -1
    """This rank's compute is ``straggler_factor`` times longer (-1: none)."""
    straggler_factor: float = 2.0
    warmup: int = 4
    iters: int = 12
    bucket_mb: float = 25.0
    overlap: str = "step"
    """ours: DecentralizedAdam(comm=Comm(overlap=...))."""
    hierarchical: bool = True
    """ours: multi-node groups summed hierarchically (the default) or by one flat ring (False)."""
    accum_steps: int = 4
    update_ms_per_mb: float = 0.0
    """> 0: the optimizer arithmetic sleeps this long per MB of parameters instead of running."""


@dataclass
class RankResult:
    """What one rank measured."""

    rank: int
    start: float
    ends: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    bytes_sent: int = 0
    link_bytes_out: int = -1  # local rank 0 only: bytes through this node's uplink tbf
    cpu_busy: float = -1.0  # rank 0 only: share of the machine's cores busy during the measured window
    calibration: dict[str, float] = field(default_factory=dict)


class _Sleep(torch.autograd.Function):
    """Identity on ``x`` that sleeps in forward and backward and yields a fixed gradient for ``weight``."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, forward_s: float, backward_s: float, grad: Tensor
    ) -> Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        ctx.grad = grad
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        time.sleep(ctx.backward_s)
        return grad_out, ctx.grad, None, None, None


class EmulatedModel(nn.Module):
    """``layers`` big parameters; forward + backward sleep ``compute_s`` in total."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        super().__init__()
        numel = spec.param_bytes // 4 // spec.layers
        generator = torch.Generator().manual_seed(0)  # same initial parameters on every rank
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.randn(numel, generator=generator) * 0.02) for _ in range(spec.layers)]
        )
        generator.manual_seed(1000 + rank)  # rank-specific "data"
        self.grad = torch.randn(numel, generator=generator) * 1e-3
        compute_s = spec.compute_ms / 1e3 * (spec.straggler_factor if rank == spec.straggler_rank else 1.0)
        self.forward_s = compute_s * spec.forward_fraction / spec.layers
        self.backward_s = compute_s * (1 - spec.forward_fraction) / spec.layers
        self.x = torch.zeros(1, requires_grad=True)

    def forward(self) -> Tensor:
        x = self.x
        for weight in self.weights:
            x = _Sleep.apply(x, weight, self.forward_s, self.backward_s, self.grad)  # type: ignore[no-untyped-call]
        return x.sum()

    @property
    def backward_sleep_s(self) -> float:
        return self.backward_s * len(self.weights)


def _tbf_sent_bytes() -> int:
    """Bytes this node's uplink tbf has sent, or -1 where there is none (outside an emulated node)."""
    try:
        out = subprocess.run(
            ["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
    except FileNotFoundError:  # no iproute2
        return -1
    match = re.search(r"qdisc tbf .*?Sent (\d+) bytes", out, re.S)
    return int(match.group(1)) if match else -1


def host_cpu_jiffies(stat: str | None = None) -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from the ``cpu`` line of ``/proc/stat``.

    Idle and iowait count as not busy; guest time is already inside user/nice and is not added twice.
    """
    if stat is None:
        with open("/proc/stat") as f:
            stat = f.read()
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            idle = values[3] + values[4]
            return sum(values) - idle, sum(values)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of CPU time that was busy between two ``host_cpu_jiffies`` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


class EmulatedUpdate(torch.optim.Optimizer):
    """An optimizer whose step takes as long as a device's would on its parameters, and changes nothing."""

    def __init__(self, params: Any, ms_per_mb: float) -> None:
        super().__init__(params, {})
        self.ms_per_mb = ms_per_mb

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        time.sleep(_update_seconds([p for g in self.param_groups for p in g["params"]], self.ms_per_mb))


def _update_seconds(params: list[Tensor], ms_per_mb: float) -> float:
    return ms_per_mb / 1e3 * sum(p.numel() * p.element_size() for p in params) / 1e6


def decentadam_update(spec: WorkerSpec) -> LocalUpdate | None:
    """DecentralizedAdam's local update: a sleep as long as the device's AccumAdamW update when
    emulating one (mixing and copies stay real), else None (the real update)."""
    if spec.update_ms_per_mb <= 0:
        return None

    def sleeping_update(state: Any, group: dict[str, Any], params: list[Tensor], source: Any) -> None:
        time.sleep(_update_seconds(params, spec.update_ms_per_mb))

    return sleeping_update


def _torch_optimizer(spec: WorkerSpec, params: Any) -> torch.optim.Optimizer:
    if spec.update_ms_per_mb > 0:
        return EmulatedUpdate(params, spec.update_ms_per_mb)
    return torch.optim.AdamW(params, lr=LR, foreach=True)


# ---------------------------------------------------------------------------------------- methods


def run_allreduce(spec: WorkerSpec, model: EmulatedModel, result: RankResult) -> None:
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=spec.bucket_mb)
    optimizer = _torch_optimizer(spec, model.parameters())

    def iteration() -> tuple[float, float]:
        optimizer.zero_grad(set_to_none=True)
        loss = ddp()
        t_forward = time.perf_counter()
        loss.backward()
        t_backward = time.perf_counter()
        optimizer.step()
        return t_backward - t_forward - model.backward_sleep_s, time.perf_counter() - t_backward

    _measure(spec, iteration, result)


def run_ours(spec: WorkerSpec, model: EmulatedModel, result: RankResult) -> None:
    optimizer = DecentralizedAdam(
        model.parameters(),
        lr=LR,
        # AccumAdam's window, as decent-dp's AccumAdamW(accum_iter=...)
        setting=plain(spec.topology, second_moment=Local(spec.accum_steps)),  # as decent-dp makes it
        comm=Comm(
            local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
            bucket_size_mb=spec.bucket_mb,
            overlap="backward" if spec.overlap == "backward" else "step",
            hierarchical=spec.hierarchical,
            local_update=decentadam_update(spec),
        ),
    )

    def iteration() -> tuple[float, float]:
        optimizer.zero_grad(set_to_none=True)
        wait_before = optimizer.stats.wait_seconds
        loss = model()
        loss.backward()
        t_backward = time.perf_counter()
        optimizer.step()
        wait = optimizer.stats.wait_seconds - wait_before
        return wait, time.perf_counter() - t_backward - (wait if spec.overlap == "step" else 0.0)

    bytes_before = optimizer.stats.bytes_sent

    def on_start() -> None:
        nonlocal bytes_before
        bytes_before = optimizer.stats.bytes_sent

    _measure(spec, iteration, result, on_start)
    optimizer.wait_for_exchanges()  # before main() destroys the process groups
    result.bytes_sent = optimizer.stats.bytes_sent - bytes_before


def run_exchange(spec: WorkerSpec, model: EmulatedModel, result: RankResult) -> None:
    """The exchanges of ``ours`` without compute or update: each step sums every bucket over its group.

    The buffers are DecentralizedAdam's own buckets (never stepped here), zeroed so that the sums
    stay zero and need no rescaling between steps.
    """
    rank = dist.get_rank()
    optimizer = DecentralizedAdam(
        model.parameters(),
        setting=plain(spec.topology),
        comm=Comm(
            local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
            bucket_size_mb=spec.bucket_mb,
            hierarchical=spec.hierarchical,
        ),
    )
    topology, communicator = optimizer.topology, optimizer.communicator
    buffers = [bucket.buffer.zero_() for bucket in optimizer.buckets]
    step = 0

    def iteration() -> tuple[float, float]:
        nonlocal step
        start = time.perf_counter()
        group = topology.group_of(rank, step)
        if len(group) > 1:
            for handle in [communicator.group_sum(b, group) for b in buffers]:
                handle.wait()
            result.bytes_sent += sum(b.numel() * b.element_size() for b in buffers)
        step += 1
        return time.perf_counter() - start, 0.0

    _measure(spec, iteration, result, on_start=lambda: setattr(result, "bytes_sent", 0))


def run_decent_dp(spec: WorkerSpec, model: EmulatedModel, result: RankResult) -> None:
    from decent_dp.ddp import DecentralizedDataParallel
    from decent_dp.optim import optim_fn_accum_adamw

    optim_fn: Any = partial(optim_fn_accum_adamw, lr=LR, weight_decay=0.0, accum_iter=spec.accum_steps)
    if spec.update_ms_per_mb > 0:

        def optim_fn(named: list[tuple[str, Tensor]]) -> torch.optim.Optimizer:
            return EmulatedUpdate([p for _, p in named], spec.update_ms_per_mb)

    wrapped = DecentralizedDataParallel(
        model,
        optim_fn=optim_fn,
        topology=spec.topology,
        bucket_size_in_mb=int(spec.bucket_mb),
        _local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
    )

    def iteration() -> tuple[float, float]:
        loss = wrapped()
        t_forward = time.perf_counter()
        loss.backward()  # decent-dp waits, mixes, steps and sends from its hooks, inside backward
        return time.perf_counter() - t_forward - model.backward_sleep_s, 0.0

    _measure(spec, iteration, result)


def _measure(
    spec: WorkerSpec,
    iteration: Any,
    result: RankResult,
    on_start: Any = None,
) -> None:
    # No barrier after the warm-up: it would let the exchange in flight progress unmeasured. Each rank
    # measures its own steady-state iterations; the uplink counter is read right after an exchange
    # started, so the window holds whole exchanges (one in flight at each end, none progressed).
    for _ in range(spec.warmup):
        iteration()
    local_rank = int(os.environ["LOCAL_RANK"])
    tbf_before = _tbf_sent_bytes() if local_rank == 0 else -1
    if on_start is not None:
        on_start()
    cpu_before = host_cpu_jiffies() if result.rank == 0 else (0, 0)
    result.start = time.perf_counter()
    for _ in range(spec.iters):
        wait, update = iteration()
        result.ends.append(time.perf_counter())
        result.wait_s.append(wait)
        result.update_s.append(update)
    if result.rank == 0:
        result.cpu_busy = busy_share(cpu_before, host_cpu_jiffies())
    if local_rank == 0:
        result.link_bytes_out = _tbf_sent_bytes() - tbf_before


# ------------------------------------------------------------------------------------ calibration


class _NoCommunication:
    """A communicator whose exchanges finish at once: DecentralizedAdam's step without the network."""

    class _Done:
        def wait(self, timeout: timedelta = timedelta(0)) -> object:
            return True

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def group_sum(self, tensor: Tensor, group: Group) -> Handle:
        return self._Done()

    def world_sum(self, tensor: Tensor) -> None:
        return None

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        return None


def run_calibrate(spec: WorkerSpec, model: EmulatedModel, result: RankResult) -> None:
    """Time each optimizer step with all ranks stepping at once (as they do after a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for p in model.parameters():
        p.grad = model.grad.clone()

    def timed(step: Any, steps: int = 3 * spec.accum_steps) -> float:
        for _ in range(2):
            step()
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.mean(times)  # over whole accumulation windows: commit steps included

    # The intra-node link as gloo sees it: every node's ranks all-reduce S bytes at once over lo.
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    node_groups = [dist.new_group(list(range(j * local, (j + 1) * local))) for j in range(world // local)]
    if local > 1:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        group = node_groups[rank // local]
        durations = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat, group=group)
            durations.append(time.perf_counter() - start)
        result.calibration["intra_allreduce_s"] = statistics.median(durations)
        del flat
    adamw = _torch_optimizer(spec, model.parameters())
    result.calibration["adamw_s"] = timed(adamw.step)
    del adamw
    ours = DecentralizedAdam(
        model.parameters(),
        lr=LR,
        # ring: every step a pair, so every step mixes and copies its send buffer
        setting=plain("ring", second_moment=Local(spec.accum_steps)),
        comm=Comm(
            bucket_size_mb=spec.bucket_mb,
            communicator=_NoCommunication(rank, world),
            local_update=decentadam_update(spec),
        ),
    )
    result.calibration["ours_update_s"] = timed(ours.step)
    del ours
    try:
        from decent_dp.optim import AccumAdamW as PeerAccumAdamW
    except ImportError:
        return
    # decent-dp's per-bucket sequence (ddp.py _ddp_fn): mix (mul_, add_), step, zero_grad, copy, scale
    params = list(model.parameters())
    grads = [p.grad for p in params]
    block = torch.empty(sum(p.numel() for p in params))
    comm = torch.zeros_like(block)
    peer: torch.optim.Optimizer = PeerAccumAdamW(
        [{"params": params, "weight_decay": 0.0}], lr=LR, accum_iter=spec.accum_steps
    )
    if spec.update_ms_per_mb > 0:
        peer = EmulatedUpdate(params, spec.update_ms_per_mb)

    def peer_step() -> None:
        block.mul_(0.5)
        block.add_(comm)
        peer.step()
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # its zero_grad sets None; the next backward would refill
        comm.copy_(block)
        comm.mul_(0.5)

    result.calibration["decent_dp_update_s"] = timed(peer_step)


def main() -> int:
    spec = WorkerSpec(**json.loads(sys.argv[1]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    model = EmulatedModel(spec, rank)
    result = RankResult(rank=rank, start=0.0)
    runners = {
        "allreduce": run_allreduce,
        "ours": run_ours,
        "decent-dp": run_decent_dp,
        "exchange": run_exchange,
        "calibrate": run_calibrate,
    }
    runners[spec.method](spec, model, result)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, asdict(result))
    if rank == 0:
        with open(spec.out, "w") as f:
            json.dump({"spec": asdict(spec), "ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
