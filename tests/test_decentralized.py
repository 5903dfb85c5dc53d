"""DecentralizedAdam on real gloo process groups == an independent simulation of n workers."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from decentadam import Comm, DecentralizedAdam, Global, Setting, make_setting
from decentadam.collectives import ProcessGroupCommunicator
from decentadam.simulation import SimulatedCluster
from decentadam.topology import build, changing_groups, over_nodes, with_global_average
from tests.distributed_harness import run_distributed

STEPS = 30
LR, BETAS, EPS, WD = 3e-2, (0.9, 0.999), 1e-8, 0.05

# (topology, local_world_size, accum_steps, overlap, second_moment); "group_gradient:K": v_every=K
CONFIGS_4 = [
    ("complete", 1, 4, "step", "local"),
    ("ring", 1, 4, "step", "local"),
    ("one-peer-exp", 1, 4, "step", "local"),
    ("aer", 2, 4, "step", "local"),
    ("aer", 1, 1, "step", "local"),
    ("aer", 2, 4, "backward", "local"),
    ("ring", 1, 2, "backward", "local"),
    ("aer", 2, 4, "resume:step", "local"),  # rebuilt from state_dicts half-way
    ("aer", 2, 4, "resume:backward", "local"),
    ("aer", 2, 4, "reload:backward", "local"),  # load_state_dict into the running, calibrated optimizer
    ("complete", 1, 1, "step", "all_ranks"),
    ("ring", 1, 1, "step", "all_ranks"),
    ("aer", 2, 1, "step", "all_ranks"),
    ("aer", 2, 1, "backward", "all_ranks"),
    ("aer", 2, 1, "resume:step", "all_ranks"),
    ("aer", 2, 1, "step", "group_gradient:2"),  # the node's pairs (q = 2 of n = 4)
    ("aer", 2, 1, "step", "group_gradient:1"),  # and every other step all ranks (hierarchical)
    ("complete", 1, 1, "step", "group_gradient:1"),  # z = the all-reduced gradient's square
    ("complete", 1, 1, "step", "group_gradient:2"),
    ("ring", 1, 1, "backward", "group_gradient:1"),
    ("aer", 2, 1, "resume:step", "group_gradient:1"),  # saved with a gradient sum in flight
    # "node+": intra_node="all_reduce", the gradients averaged inside nodes of L ranks
    ("aer", 2, 1, "step", "node+group_gradient"),  # 2 nodes: a rest, then the nodes average
    ("complete", 2, 1, "backward", "node+all_ranks"),  # all_ranks corrects for N = 2 nodes
    ("ring", 1, 1, "step", "node+local"),  # nodes of one rank: gossip as before
    ("aer", 2, 1, "step", "node+local"),  # the node's own v: only g is summed in the node
    ("aer", 2, 1, "resume:step", "node+group_gradient"),
    ("complete", 4, 1, "step", "node+group_gradient"),  # one node: All-Reduce's AdamW (nothing shared)
    # "+bf16": exchange="bf16_updates", the nodes' updates from r in bfloat16 (2 nodes: a pair's sum)
    ("complete", 2, 1, "step", "node+group_gradient+bf16"),
    # "+shareK": share_second_moment_every=K (default 0), the nodes' A averaged with every K-th exchange
    ("aer", 2, 1, "step", "node+group_gradient+share2+bf16"),  # a rest every other step: r waits
    ("aer", 2, 1, "resume:step", "node+group_gradient+share2+bf16"),  # r and A from the state: exact resume
    ("complete", 2, 1, "backward", "node+all_ranks+bf16"),
    ("complete", 2, 1, "step", "node+group_gradient+share2+bf16"),
    ("complete", 2, 1, "resume:step", "node+group_gradient+share2+bf16"),  # an A in flight at the save
    ("aer", 2, 1, "backward", "node+group_gradient+share1"),  # a rest every other step: no A sent
    # "syncW:": sync_steps=W, the first W steps mix before returning (a synchronous warm-up)
    ("complete", 2, 1, "sync20:step", "node+group_gradient+share2+bf16"),
    ("complete", 2, 1, "resume:sync20:step", "node+group_gradient+share2+bf16"),  # saved within it
    ("aer", 2, 1, "sync10:backward", "all_ranks"),  # changing groups, then overlapped again
    # "+avgK" on the topology: average_every=K, every K-th step the exact average over all ranks
    ("one-peer-exp+avg4", 1, 1, "step", "all_ranks"),
    ("one-peer-exp+avg4", 1, 1, "step", "all_ranks+bf16"),  # changing pairs: r moves at the averages
    ("aer+avg3", 1, 1, "backward", "local+bf16"),  # rests, and an average that is not on aer's beat
    # "global": the ranks' all_ranks estimates averaged at the exact averages (bf16), floor V / n**2
    ("complete", 1, 1, "step", "global"),
    ("one-peer-exp+avg4", 1, 1, "step", "global+bf16"),
    ("one-peer-exp+avg4", 1, 1, "resume:step", "global+bf16"),  # r and P from the state: exact resume
    ("one-peer-exp+avg4", 1, 1, "backward", "global"),
    ("aer+avg4", 2, 1, "step", "node+global+bf16"),  # 2 nodes of 2: N = 2 in the correction
    ("one-peer-exp+avg4", 1, 1, "sync30:step", "global+bf16"),  # every step mixed before returning
]
CONFIGS_8 = [
    ("complete", 1, 4, "step", "local"),
    ("ring", 1, 4, "step", "local"),
    ("one-peer-exp", 1, 4, "step", "local"),
    ("aer", 2, 4, "step", "local"),
    ("aer", 4, 4, "step", "local"),
    ("aer", 2, 4, "backward", "local"),
    ("one-peer-exp", 1, 1, "step", "all_ranks"),
    ("aer", 2, 1, "step", "all_ranks"),
    ("aer", 2, 1, "step", "node+group_gradient+share2"),  # 4 nodes of 2
    ("one-peer-exp", 4, 1, "backward", "node+group_gradient+share2"),
    # 4 nodes; gloo's bfloat16 sums over 8 ranks round the shared A several times (2e-3 off the
    # simulation's rank order after 30 steps), so here only the updates are bfloat16
    ("complete", 2, 1, "step", "node+group_gradient+bf16"),
    ("aer", 2, 1, "step", "node+group_gradient+share1"),  # 4 nodes in changing pairs: A mixes
    ("one-peer-exp+avg4", 1, 1, "step", "global+bf16"),  # 8 ranks: gloo rounds the bf16 sums more
]
Config = tuple[str, int, int, str, str]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": WD}, {"params": biases, "weight_decay": 0.0}]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific data: every rank sees different samples of the same teacher."""
    generator = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    teacher = torch.linspace(-1.0, 1.0, 18, dtype=torch.float64).reshape(6, 3)
    return x, torch.sin(x @ teacher)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def parse_second_moment(second_moment: str) -> tuple[str, int, bool, int | None, bool]:
    """A config's ``second_moment`` as (name, K, node, share, bf16): ``"group_gradient:K"`` is
    ``second_moment="group_gradient", v_every=K``; a ``"node+"`` prefix is
    ``intra_node="all_reduce"``, a ``"+shareK"`` part ``share_second_moment_every=K`` (``None``
    where absent: the default, 0), a ``"+bf16"`` suffix ``exchange="bf16_updates"``."""
    first, *rest = second_moment.split("+")
    node = first == "node"
    if node:
        first, *rest = rest
    name, _, every = first.partition(":")
    share = next((int(part.removeprefix("share")) for part in rest if part.startswith("share")), None)
    return name, int(every or 0), node, share, "bf16" in rest


def share_of(second_moment: str) -> int:
    """K of a config's shared second moment: its ``"+shareK"``, else 0 (the default: not shared)."""
    return parse_second_moment(second_moment)[3] or 0


def second_moment_args(second_moment: str) -> dict[str, Any]:
    """The optimizer's keyword arguments of a config's ``second_moment`` (:func:`parse_second_moment`)."""
    name, every, node, share, bf16 = parse_second_moment(second_moment)
    return {
        "second_moment": Global(floored=False) if name == "global_raw" else name,
        **({"v_every": every} if every else {}),
        "intra_node": "all_reduce" if node else "gossip",
        **({"share_second_moment_every": share} if share is not None else {}),
        "exchange": "bf16_updates" if bf16 else "parameters",
    }


def parse_topology(name: str) -> tuple[str, int]:
    """A config's topology as (name, K): ``"one-peer-exp+avg4"`` is ``topology="one-peer-exp",
    average_every=4`` (K = 0 where absent)."""
    base, _, every = name.partition("+avg")
    return base, int(every or 0)


ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "accum_steps", "foreach")


def built(params: Any, **flat: Any) -> DecentralizedAdam:
    """DecentralizedAdam from options given flat, as a configuration file holds them: the setting's
    through ``make_setting``, the communication's through ``Comm``."""
    comm_keys = {field.name for field in dataclasses.fields(Comm)}
    adam = {k: v for k, v in flat.items() if k in ADAM_KEYS}
    comm = {k: v for k, v in flat.items() if k in comm_keys}
    setting = {k: v for k, v in flat.items() if k not in adam and k not in comm}
    return DecentralizedAdam(
        params, **adam, setting=make_setting(**setting) if setting else None, comm=Comm(**comm)
    )


def make_optimizer(
    model: nn.Module, name: str, local_world_size: int, accum_steps: int, overlap: str, second_moment: str
) -> DecentralizedAdam:
    base, average_every = parse_topology(name)
    setting = make_setting(
        **second_moment_args(second_moment),
        average_every=average_every,
        topology=base,
        sync_steps=sync_of(overlap),
    )
    return DecentralizedAdam(
        param_groups(model),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        accum_steps=accum_steps,
        setting=setting,
        comm=Comm(
            local_world_size=local_world_size,
            bucket_size_mb=1e-4,  # ~100 bytes: several buckets per parameter group
            overlap=overlap.split(":")[-1],  # type: ignore[arg-type]
        ),
    )


def sync_of(overlap: str) -> int:
    """W of a config's ``"syncW:"`` part (``sync_steps``), else 0."""
    return next((int(part.removeprefix("sync")) for part in overlap.split(":") if part.startswith("sync")), 0)


def train_worker(rank: int, world_size: int, configs: list[Config]) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        overlap = config[3]
        model = make_model(seed=100 + rank)  # different on every rank: the broadcast must fix it
        optimizer = make_optimizer(model, *config)
        for step in range(STEPS):
            if overlap.startswith("resume:") and step == STEPS // 2:
                model, optimizer = resume(model, optimizer, config)
            if overlap.startswith("reload:") and step == STEPS // 2:
                optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            optimizer.step()
        local = flat(model)
        with optimizer.average_parameters():
            average = flat(model)
        restored = flat(model)
        out.append(
            {
                "local": local,
                "average": average,
                "restored_equal": bool(torch.equal(local, restored)),
                "consensus": optimizer.consensus_distance(),
                "bytes_sent": optimizer.stats.bytes_sent,
                "ref": torch.cat([optimizer.state[q]["exchange_ref"].reshape(-1) for q in model.parameters()])
                if optimizer.setting.exchange == "bf16_updates"
                else None,
            }
        )
    return out


def resume(
    model: nn.Module, optimizer: DecentralizedAdam, config: Config
) -> tuple[nn.Module, DecentralizedAdam]:
    """A new process's view: fresh model and optimizer, then this rank's saved states loaded."""
    model_state, optimizer_state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    new_model = make_model(seed=999)
    new_optimizer = make_optimizer(new_model, *config)
    new_model.load_state_dict(model_state)  # after construction: its broadcast must not win
    new_optimizer.load_state_dict(optimizer_state)
    assert new_optimizer.step_count == STEPS // 2
    return new_model, new_optimizer


def simulate(
    name: str,
    world_size: int,
    local_world_size: int,
    accum_steps: int,
    second_moment: str = "local",
    sync_steps: int = 0,
    steps: int = STEPS,
) -> torch.Tensor:
    """n workers in one process: mix with W(t), then the AccumAdamW formula written out plainly
    (with ``second_moment="all_ranks"``: s = 1 and the noise-corrected second moment, n = world_size;
    with ``"group_gradient:K"`` also the second moment A from the group's gradients of every K-th
    step, which arrive one step later, rounded to bfloat16 and summed in bfloat16 by a pair, in
    float32 by a larger group; with ``"+shareK"`` every K-th step each rank's ``A`` in bfloat16,
    summed over the nodes' group in float32 and rounded once, whose mean replaces ``A`` at the next
    step before its ``z``, and the floor ``V / N**2``). The parameters sent after each of the first
    ``sync_steps`` steps are mixed before the next gradient instead of after it. ``steps``: how
    many steps."""
    # node: intra_node="all_reduce", nodes of L ranks act as one; bf16: exchange="bf16_updates",
    # x += S/m - q, r += S/m; share_every: share_second_moment_every
    kind, v_every, node, _, bf16 = parse_second_moment(second_moment)
    share_every = share_of(second_moment)
    size = local_world_size if node else 1  # L
    noise_ranks = world_size // size  # all_ranks' n: the nodes' count N with node-averaged gradients
    floor = noise_ranks**2 if share_every else noise_ranks
    name, average_every = parse_topology(name)
    if node:  # the nodes' topology, each of its groups averaging all ranks of its nodes
        nodes = with_global_average(build(name, world_size // size, 1), average_every)
        within = torch.full((size, size), 1.0 / size, dtype=torch.float64)
        mixing = [torch.kron(nodes.mixing_matrix(t), within) for t in range(nodes.period)]
        groups = with_global_average(over_nodes(name, world_size, size), average_every)
    else:
        topology = with_global_average(build(name, world_size, local_world_size), average_every)
        mixing = [topology.mixing_matrix(t) for t in range(topology.period)]
        groups = topology
    fixed = changing_groups(groups) is None  # bf16: r moves with a fixed group, else at the averages
    models = [make_model(seed=100) for _ in range(world_size)]  # rank 0's initialisation everywhere
    refs = [flat(m).clone() for m in models]  # bf16: r, alike on every rank
    decay = [WD if n.endswith("weight") else 0.0 for n, _ in models[0].named_parameters()]
    beta1, beta2 = BETAS
    state = [[dict.fromkeys(("M", "V", "b", "S", "A", "u"), 0.0) for _ in decay] for _ in models]
    sent: list[list[torch.Tensor]] | None = None  # group_gradient: the last step's gradients, if sent
    shared: list[list[torch.Tensor]] | None = None  # share: the last step's A (bf16), if sent
    estimates: list[list[torch.Tensor]] | None = None  # global: the last step's own v (bf16), if sent
    pooled: list[torch.Tensor | None] = [None] * len(decay)  # global: P, the ranks' mean estimate

    def mix(step: int) -> torch.Tensor:
        """x_i <- sum_j W_ij(step) x_j (bf16: x_i += S/m - q_i, r += S/m), as (n, numel)."""
        mixed = mixing[step % len(mixing)] @ torch.stack([flat(m) for m in models])  # (n, numel)
        if bf16:
            updates = [(flat(m) - r).to(torch.bfloat16) for m, r in zip(models, refs, strict=True)]
            for rank in range(world_size):
                members = groups.group_of(rank, step)
                if len(members) == 1:
                    mixed[rank] = flat(models[rank])
                    continue
                total = sum(
                    (updates[j].float() for j in members), torch.zeros_like(updates[0], dtype=torch.float32)
                )
                mean = total.to(torch.bfloat16).double() / len(members)  # summed exactly, rounded once
                mixed[rank] = flat(models[rank]) + mean - updates[rank].double()
                if fixed or len(members) == world_size:
                    refs[rank] = refs[rank] + mean
        return mixed

    for step in range(steps):
        early = 1 <= step <= sync_steps  # step `step` (1-based) mixed before returning: x for this gradient
        if early:
            for rank, row in enumerate(mix(step)):
                torch.nn.utils.vector_to_parameters(row, models[rank].parameters())
        grads = []
        for rank, model in enumerate(models):
            model.zero_grad()
            loss_of(model, rank, step).backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        for rank in range(world_size if shared is not None else 0):  # A = the group's mean A
            members = groups.group_of(rank, step)
            if len(members) == 1:  # a node that rests sends nothing and keeps its own A
                continue
            for j, st in enumerate(state[rank]):
                total = sum(
                    (shared[r][j].float() for r in members),
                    torch.zeros_like(shared[rank][j], dtype=torch.float32),
                )
                st["A"] = total.to(torch.bfloat16).double() / len(members)
        shared = None
        if estimates is not None:  # global: P = the mean of the ranks' estimates, alike on every rank
            for j in range(len(decay)):
                total = sum((e[j].float() for e in estimates), torch.zeros_like(estimates[0][j]).float())
                pooled[j] = total.to(torch.bfloat16).double() / world_size
        estimates = None
        if node:  # every rank steps with its node's mean gradient; z from the node's gradients
            v_every = 1
            for first in range(0, world_size, size):
                ranks = range(first, first + size)
                means = [sum(grads[r][j] for r in ranks) / size for j in range(len(decay))]
                squares = [sum(grads[r][j] ** 2 for r in ranks) / size for j in range(len(decay))]
                spreads = [sq - m**2 for sq, m in zip(squares, means, strict=True)]
                share = (1 / size - 1 / world_size) / (1 - 1 / size) if size > 1 else 0.0
                for r in ranks:
                    grads[r] = [m.clone() for m in means]
                    if kind == "group_gradient":
                        for j, st in enumerate(state[r]):
                            st["A"] = beta2 * st["A"] + (1 - beta2) * (means[j] ** 2 - spreads[j] * share)
                            st["u"] += 1
        for rank in range(world_size if sent is not None else 0):
            members = topology.group_of(rank, step)
            q = len(members)
            if q == 1:
                continue
            share = (1 / q - 1 / world_size) / (1 - 1 / q)
            for j, s in enumerate(state[rank]):
                if q == 2:  # bf16(a + b), as torch adds two bfloat16 tensors
                    total = (sent[members[0]][j] + sent[members[1]][j]).float()
                else:
                    total = torch.zeros_like(sent[rank][j], dtype=torch.float32)
                    for member in members:
                        total = total + sent[member][j].float()
                mean = total / q
                own = sent[rank][j].float()
                z = mean.square() - (own.square() - mean.square()) * share
                s["A"] = beta2**v_every * s["A"] + (1 - beta2**v_every) * z.double()
                s["u"] += 1
        sent = None
        if v_every and not node and (step + 1) % v_every == 0:  # with the parameters, to the next group
            sent = [[g.to(torch.bfloat16) for g in rank_grads] for rank_grads in grads]
        mixed = torch.stack([flat(m) for m in models]) if early else mix(step)
        t = step + 1
        k = math.ceil(t / accum_steps)
        for rank, model in enumerate(models):
            torch.nn.utils.vector_to_parameters(mixed[rank], model.parameters())
            with torch.no_grad():
                for j, p in enumerate(model.parameters()):
                    s, g = state[rank][j], grads[rank][j]
                    p.mul_(1 - LR * decay[j])
                    if kind in ("all_ranks", "group_gradient", "global", "global_raw"):
                        if t > 1:
                            deviation = g - s["M"] / (1 - beta1 ** (t - 1))
                            s["S"] = beta2 * s["S"] + (1 - beta2) * (1 + beta1) / 2 * deviation**2
                        s["M"] = beta1 * s["M"] + (1 - beta1) * g
                        s["V"] = beta2 * s["V"] + (1 - beta2) * g * g
                        v = s["V"] / (1 - beta2**t)
                        if noise_ranks == 1:
                            pass  # one node: the node's mean is All-Reduce's, AdamW's v
                        elif (shared_v := pooled[j]) is not None:
                            v = torch.maximum(shared_v, v / noise_ranks**2)
                        elif s["u"] > 0:
                            v = torch.maximum(s["A"] / (1 - beta2 ** (v_every * s["u"])), v / floor)
                        elif t > 1:
                            corrected = v - (1 - 1 / noise_ranks) * s["S"] / (1 - beta2 ** (t - 1))
                            v = torch.maximum(corrected, v / noise_ranks)
                        p.sub_(LR * (s["M"] / (1 - beta1**t)) / (v.sqrt() + EPS))
                        continue
                    m = beta1 * s["M"] + (1 - beta1) * g
                    v = beta2 * s["V"] + (1 - beta2) * g * g
                    p.sub_(LR * (m / (1 - beta1**k)) / ((v / (1 - beta2**k)).sqrt() + EPS))
                    s["b"] = s["b"] + g / accum_steps
                    if t % accum_steps == 0:
                        s["M"] = beta1 * s["M"] + (1 - beta1) * s["b"]
                        s["V"] = beta2 * s["V"] + (1 - beta2) * s["b"] ** 2
                        s["b"] = 0.0
        if share_every and (step + 1) % share_every == 0:  # with the parameters, to the nodes' next group
            shared = [[st["A"].to(torch.bfloat16) for st in state[rank]] for rank in range(world_size)]
        if kind.startswith("global") and len(groups.group_of(0, step + 1)) == world_size:  # own v
            estimates = []
            for rank in range(world_size):
                own = []
                for st in state[rank]:
                    v = st["V"] / (1 - beta2**t)
                    if t > 1 and noise_ranks > 1:
                        corrected = v - (1 - 1 / noise_ranks) * st["S"] / (1 - beta2 ** (t - 1))
                        v = corrected if kind == "global_raw" else torch.maximum(corrected, v / noise_ranks)
                    own.append(v.to(torch.bfloat16))
                estimates.append(own)
    if 1 <= steps <= sync_steps:  # the last step mixes before returning too
        for rank, row in enumerate(mix(steps)):
            torch.nn.utils.vector_to_parameters(row, models[rank].parameters())
    return torch.stack([flat(m) for m in models])


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world_size", "configs"), [(4, CONFIGS_4), (8, CONFIGS_8)])
def test_matches_simulation_of_n_workers(world_size: int, configs: list[Config]) -> None:
    per_rank = run_distributed(train_worker, world_size, configs, timeout_s=480)
    for index, (name, local_world_size, accum_steps, overlap, second_moment) in enumerate(configs):
        label = f"{name} L={local_world_size} s={accum_steps} overlap={overlap} {second_moment}"
        expected = simulate(name, world_size, local_world_size, accum_steps, second_moment, sync_of(overlap))
        got = torch.stack([per_rank[r][index]["local"] for r in range(world_size)])
        bf16 = second_moment.endswith("+bf16")
        # bf16 updates: gloo adds a group's bfloat16 values in its own order (the last numel % L of
        # a bucket flat over the group, more than 2 nodes in a ring), which rounds some sums twice;
        # test_bf16_updates_equal_the_simulation_in_one_process pins the math bitwise; the same holds
        # for the nodes' A of "+shareK" (test_shared_second_moment_equals_the_simulation_in_one_process)
        shared = share_of(second_moment) and world_size > local_world_size  # A summed over nodes
        shared = shared or "global" in second_moment  # the ranks' v summed in bfloat16 by gloo
        atol = 1e-3 if bf16 or shared else 1e-10
        if "+avg" in name and (bf16 or shared):  # updates of up to K steps, summed over all ranks by gloo
            atol = 5e-3  # (test_exact_averages_equal_the_simulation_in_one_process pins the math)
        torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=lambda m, lab=label: f"{lab}: {m}")
        if sync_of(overlap):  # the warm-up moves the run by far more than the tolerance
            overlapped = simulate(name, world_size, local_world_size, accum_steps, second_moment)
            assert (expected - overlapped).abs().max().item() > 10 * atol, label
        if bf16:  # r stays bitwise alike on every rank (the sums arrive alike)
            for r in range(1, world_size):
                assert torch.equal(per_rank[r][index]["ref"], per_rank[0][index]["ref"]), label
        if overlap.startswith("resume:") and bf16:  # r from the state: exactly the uninterrupted run
            plain = configs.index(
                (name, local_world_size, accum_steps, overlap.removeprefix("resume:"), second_moment)
            )
            for r in range(world_size):
                assert torch.equal(per_rank[r][index]["local"], per_rank[r][plain]["local"]), label
                assert torch.equal(per_rank[r][index]["ref"], per_rank[r][plain]["ref"]), label
        mean = expected.mean(dim=0)
        for r in range(world_size):
            result = per_rank[r][index]
            torch.testing.assert_close(result["average"], mean, rtol=0, atol=atol)
            assert result["restored_equal"], label
        distance = (expected - mean).square().sum(dim=1).mean().item()
        if atol == 1e-10:
            assert per_rank[0][index]["consensus"] == pytest.approx(distance, rel=1e-8, abs=1e-14), label
        if name != "complete":
            assert distance > 0, f"{label}: ranks with different data should not agree exactly"
        if second_moment.startswith("node+"):  # a node's ranks are replicas; each sends g (and g**2) in it
            for first in range(0, world_size, local_world_size):
                for r in range(first + 1, first + local_world_size):
                    assert torch.equal(got[r], got[first]), f"{label}: rank {r} left its node's replica"
            if ":" not in overlap:
                base, every = parse_topology(name)
                topology = with_global_average(over_nodes(base, world_size, local_world_size), every)
                numel = expected.shape[1]
                values = 2 * numel if second_moment.startswith("node+group_gradient") else numel
                node_sums = STEPS * values * 8 if local_world_size > 1 else 0
                share = share_of(second_moment)  # A in bfloat16 every share-th step
                for r in range(world_size):
                    sizes = [len(topology.group_of(r, t)) for t in range(1, STEPS + 1)]
                    exchanged = sum(numel * (2 if bf16 else 8) for q in sizes if q > 1)
                    shared = sum(
                        numel * 2 for t, q in enumerate(sizes, 1) if q > 1 and share and t % share == 0
                    )
                    if "global" in second_moment:  # each rank's v in bfloat16 to every exact average
                        shared += sum(numel * 2 for q in sizes if q == world_size)
                    assert per_rank[r][index]["bytes_sent"] == exchanged + node_sums + shared, label
        every = second_moment.partition(":")[2]
        if every and ":" not in overlap:  # float64 parameters every step, gradients every K-th:
            topology, numel = build(name, world_size, local_world_size), expected.shape[1]
            for r in range(world_size):  # bfloat16 to a pair, float32 to a larger group
                sizes = [(t, len(topology.group_of(r, t))) for t in range(1, STEPS + 1)]
                want = sum(
                    numel * 8 + (numel * (2 if q == 2 else 4) if t % int(every) == 0 else 0)
                    for t, q in sizes
                    if q > 1
                )
                assert per_rank[r][index]["bytes_sent"] == want, label


def switch_worker(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """4 steps with exchange="parameters", then the state loaded into a bf16_updates optimizer (no r
    in it) or into another parameters one, 4 more steps each."""
    config = ("complete", 2, 1, "step", "node+group_gradient+share0")
    model = make_model(seed=100 + rank)
    optimizer = make_optimizer(model, *config)
    for step in range(4):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()
    model_state, optimizer_state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    out: dict[str, torch.Tensor] = {}
    for kind in ("parameters", "bf16_updates"):
        new_model = make_model(seed=999)
        new_optimizer = make_optimizer(
            new_model, *config[:4], config[4] + ("+bf16" if kind != "parameters" else "")
        )
        new_model.load_state_dict(model_state)
        new_optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        for step in range(4, 8):
            new_optimizer.zero_grad()
            loss_of(new_model, rank, step).backward()
            new_optimizer.step()
            if step == 4:
                out[f"{kind}-first"] = flat(new_model)
        out[kind] = flat(new_model)
        if kind == "bf16_updates":
            out["ref"] = torch.cat(
                [new_optimizer.state[q]["exchange_ref"].reshape(-1) for q in new_model.parameters()]
            )
        new_optimizer.close()
    return out


def test_bf16_updates_state_from_other_groups_takes_a_whole_exchange() -> None:
    """r is only alike within the group it was saved in: a state saved with another topology, world
    size or exchange makes the next exchange send the whole parameters; the same layout keeps r."""
    cluster = SimulatedCluster(4)
    models = [make_model(seed=100) for _ in range(4)]
    optimizers = [
        DecentralizedAdam(
            param_groups(m), lr=LR,
            setting=Setting(topology="complete", intra_node="all_reduce", exchange="bf16_updates"),
            comm=Comm(local_world_size=2, communicator=cluster.communicator(rank)),
        )
        for rank, m in enumerate(models)
    ]  # fmt: skip
    optimizer = optimizers[0]
    saved = copy.deepcopy(optimizer.state_dict())
    for change, whole in (({}, False), ({"topology": "ring"}, True), ({"world_size": 8}, True)):
        state = copy.deepcopy(saved)
        state["decentralized"].update(change)
        optimizer.load_state_dict(state)
        assert optimizer._parameters.whole is whole, change
    del saved["decentralized"]
    optimizer.load_state_dict(saved)
    assert optimizer._parameters.whole


def test_bf16_updates_resume_a_state_saved_without_r_from_the_mean() -> None:
    """No r in the loaded state: the first exchange sends the whole parameters (the step equals
    exchange="parameters" bitwise) and r becomes their mean, alike on every rank."""
    per_rank = run_distributed(switch_worker, 4, timeout_s=240)
    for r in range(4):
        assert torch.equal(per_rank[r]["bf16_updates-first"], per_rank[r]["parameters-first"])
        assert torch.equal(per_rank[r]["ref"], per_rank[0]["ref"])
        torch.testing.assert_close(per_rank[r]["bf16_updates"], per_rank[r]["parameters"], rtol=0, atol=1e-3)
        assert not torch.equal(per_rank[r]["bf16_updates"], per_rank[r]["parameters"])


def run_simulated(
    setting: Setting | None,
    world_size: int,
    local_world_size: int,
    steps: int = STEPS,
    state_dict_after: int | None = None,
) -> tuple[list[nn.Module], list[DecentralizedAdam]]:
    """``steps`` steps of ``setting`` (None: the default) on simulated ranks in one process, in nodes
    of ``local_world_size``; with ``state_dict_after`` every rank's ``state_dict()`` is taken after
    that step."""
    cluster = SimulatedCluster(world_size)
    models = [make_model(seed=100) for _ in range(world_size)]
    optimizers = [
        DecentralizedAdam(
            param_groups(model), lr=LR, betas=BETAS, eps=EPS, setting=setting,
            comm=Comm(local_world_size, bucket_size_mb=1e-4, communicator=cluster.communicator(rank)),
        )
        for rank, model in enumerate(models)
    ]  # fmt: skip
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
        for optimizer in optimizers:
            optimizer.start_gradient_sums()
        for optimizer in optimizers:
            optimizer.step()
        if step == state_dict_after:
            for optimizer in optimizers:
                optimizer.state_dict()
    return models, optimizers


def train_simulated(
    name: str,
    world_size: int,
    second_moment: str,
    state_dict_after: int | None = None,
    local_world_size: int = 2,
) -> tuple[list[nn.Module], list[DecentralizedAdam]]:
    """:func:`run_simulated` of a config's topology and second moment (nodes of 2 ranks by default)."""
    base, every = parse_topology(name)
    setting = make_setting(**second_moment_args(second_moment), topology=base, average_every=every)
    return run_simulated(setting, world_size, local_world_size, state_dict_after=state_dict_after)


@pytest.mark.parametrize(
    ("name", "second_moment"),
    [
        ("complete", "node+group_gradient+share0+bf16"),
        ("aer", "node+group_gradient+share0+bf16"),
        ("complete", "node+all_ranks+bf16"),
    ],
)
def test_bf16_updates_equal_the_simulation_in_one_process(name: str, second_moment: str) -> None:
    """exchange="bf16_updates" on simulated ranks (sums rounded once) == ``simulate``, bitwise up to
    float64 summation order: x_i += S/m - q_i, r += S/m, with q_i = bf16(x_i - r). Simulated ranks
    step with ``overlap="step"``; ``overlap="backward"`` with bf16 updates is in the gloo cases."""
    world_size = 4
    models, optimizers = train_simulated(name, world_size, second_moment)
    got = torch.stack([flat(model) for model in models])
    expected = simulate(name, world_size, 2, 1, second_moment)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    parameters = simulate(name, world_size, 2, 1, second_moment.removesuffix("+bf16"))
    assert not torch.allclose(got, parameters, rtol=0, atol=1e-9)  # the bf16 rounding is there
    torch.testing.assert_close(got, parameters, rtol=0, atol=1e-3)  # and only a step's rounding
    sent = [optimizer.stats.bytes_sent for optimizer in optimizers]
    numel = got.shape[1]
    node_sums = STEPS * numel * 8 * (2 if "group_gradient" in second_moment else 1)
    mixing = over_nodes(name, world_size, 2)
    exchanges = sum(1 for t in range(1, STEPS + 1) if len(mixing.group_of(0, t)) > 1)
    assert sent == [node_sums + exchanges * numel * 2] * world_size  # bfloat16, not float64


@pytest.mark.parametrize(
    ("name", "local_world_size", "second_moment"),
    [
        ("one-peer-exp+avg4", 1, "all_ranks+bf16"),
        ("aer+avg3", 1, "local+bf16"),
        ("one-peer-exp+avg4", 1, "global"),
        ("one-peer-exp+avg4", 1, "global+bf16"),
        ("complete", 1, "global"),
        ("one-peer-exp+avg4", 1, "global_raw+bf16"),  # the raw estimates averaged, only P floored
        ("aer+avg4", 2, "node+global+bf16"),
    ],
)
def test_exact_averages_equal_the_simulation_in_one_process(
    name: str, local_world_size: int, second_moment: str
) -> None:
    """average_every, bf16 updates on changing groups (r moves at the exact averages only) and
    second_moment="global" (P = the mean of the ranks' bf16 estimates, v = max(P, V / n**2)) on
    simulated ranks, whose sums are rounded once == ``simulate``, up to float64 summation order
    (the gloo cases add gloo's own bfloat16 roundings)."""
    world_size = 4
    models, optimizers = train_simulated(name, world_size, second_moment, local_world_size=local_world_size)
    got = torch.stack([flat(model) for model in models])
    expected = simulate(name, world_size, local_world_size, 1, second_moment)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    if "+avg" in name:  # the exact averages change the run
        base = simulate(name.partition("+avg")[0], world_size, local_world_size, 1, second_moment)
        assert not torch.allclose(got, base, rtol=0, atol=1e-6)
    numel, node = got.shape[1], second_moment.startswith("node+")
    topology = optimizers[0].topology
    for rank, optimizer in enumerate(optimizers):  # float64 parameters, or bfloat16 updates; each v
        sizes = [len(topology.group_of(rank, t)) for t in range(1, STEPS + 1)]
        want = sum(numel * (2 if "bf16" in second_moment else 8) for q in sizes if q > 1)
        want += sum(numel * 2 for q in sizes if q == world_size) if "global" in second_moment else 0
        want += STEPS * numel * 8 if node else 0  # the node's gradient sums
        assert optimizer.stats.bytes_sent == want, rank


DEFAULT_AS_CONFIG = ("one-peer-exp+avg32", "node+global+bf16")
"""``DecentralizedAdam(params, lr)`` in this file's config names (Setting's field defaults)."""


def test_the_default_setting_is_written_out_in_the_config_names() -> None:
    name, second_moment = DEFAULT_AS_CONFIG
    base, every = parse_topology(name)
    assert make_setting(**second_moment_args(second_moment), topology=base, average_every=every) == Setting()
    assert Setting() == make_setting() == DecentralizedAdam(make_model(seed=0).parameters()).setting


@pytest.mark.parametrize("local_world_size", [1, 2])
def test_the_default_equals_the_simulation_of_n_workers_in_one_process(local_world_size: int) -> None:
    """``DecentralizedAdam(params, lr)`` with nothing else on 4 simulated ranks, as 4 nodes of one
    and as 2 nodes of 2, for 40 steps (the exact average at step 32 included) == ``simulate`` of the
    same options, up to float64 summation order."""
    world_size, steps = 4, 40

    def train(setting: Setting | None) -> tuple[torch.Tensor, list[DecentralizedAdam]]:
        models, optimizers = run_simulated(setting, world_size, local_world_size, steps)
        return torch.stack([flat(model) for model in models]), optimizers

    got, optimizers = train(None)
    if local_world_size == 1:  # on nodes of one rank the node's all-reduce is no exchange: gossip's run
        gossip, others = train(dataclasses.replace(Setting(), intra_node="gossip"))
        assert torch.equal(got, gossip)
        assert [o.stats.bytes_sent for o in others] == [o.stats.bytes_sent for o in optimizers]
    name, second_moment = DEFAULT_AS_CONFIG
    expected = simulate(name, world_size, local_world_size, 1, second_moment, steps=steps)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    without = simulate("one-peer-exp", world_size, local_world_size, 1, second_moment, steps=steps)
    if local_world_size == 1:  # on 4 nodes the exact average at step 32 changes the run (2 nodes: a pair)
        assert not torch.allclose(got, without, rtol=0, atol=1e-6)
    for optimizer in optimizers:
        optimizer.close()


@pytest.mark.parametrize(
    ("name", "second_moment"),
    [("complete", "node+group_gradient+share2+bf16"), ("aer", "node+group_gradient+share1")],
)
def test_shared_second_moment_equals_the_simulation_in_one_process(name: str, second_moment: str) -> None:
    """share_second_moment_every on simulated ranks == ``simulate``, bitwise up to float64 order: A
    sent in bfloat16 with every K-th exchange, its group's mean in place of A at the next step (a
    ``state_dict`` half-way folds it early and changes nothing), the floor V / N**2."""
    world_size, every = 4, share_of(second_moment)
    # an A in flight after step STEPS // 2 + 1 (K = 1, 2): folded by state_dict on every rank
    models, optimizers = train_simulated(name, world_size, second_moment, state_dict_after=STEPS // 2 + 1)
    got = torch.stack([flat(model) for model in models])
    torch.testing.assert_close(got, simulate(name, world_size, 2, 1, second_moment), rtol=0, atol=1e-13)
    own = simulate(name, world_size, 2, 1, second_moment.replace(f"+share{every}", "+share0"))
    assert not torch.allclose(got, own, rtol=0, atol=1e-9)  # the shared A and the floor change the steps
    for first, second in ((0, 1), (2, 3)):  # a node's ranks stay replicas, A included
        assert torch.equal(got[first], got[second])
        for p, q in zip(models[first].parameters(), models[second].parameters(), strict=True):
            assert torch.equal(
                optimizers[first].state[p]["group_sq"], optimizers[second].state[q]["group_sq"]
            )
    numel = got.shape[1]
    mixing = over_nodes(name, world_size, 2)
    exchanges = sum(1 for t in range(1, STEPS + 1) if len(mixing.group_of(0, t)) > 1)
    shares = sum(1 for t in range(every, STEPS + 1, every) if len(mixing.group_of(0, t)) > 1)
    per_exchange = numel * (2 if second_moment.endswith("+bf16") else 8)
    sent = STEPS * numel * 8 * 2 + exchanges * per_exchange + shares * numel * 2  # node sums, x, A
    assert [optimizer.stats.bytes_sent for optimizer in optimizers] == [sent] * world_size


def mismatched_worker(rank: int, world_size: int, difference: str) -> str:
    model = nn.Linear(4, 3 + rank if difference == "shape" else 3)
    if difference == "frozen" and rank == 1:
        model.bias.requires_grad_(False)  # bucketed differently: the first exchange would not match
    params: Any = model.parameters()
    if difference == "groups":
        params = [{"params": [model.weight]}, {"params": [model.bias]}] if rank == 0 else params
    try:
        DecentralizedAdam(params, setting=Setting(topology="ring"))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("difference", ["shape", "frozen", "groups"])
def test_different_parameters_across_ranks_fail_at_construction(difference: str) -> None:
    messages = run_distributed(mismatched_worker, 2, difference)
    for message in messages:
        assert "ranks hold different parameters" in message


def skipping_worker(rank: int, world_size: int, overlap: str) -> torch.Tensor:
    """Three equal-sized layers, one bucket each; rank 1 leaves the middle one out of two iterations."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(3)).double()
    optimizer = DecentralizedAdam(
        layers.parameters(),
        lr=LR,
        accum_steps=2,
        setting=Setting(second_moment="local", topology="complete"),
        comm=Comm(bucket_size_mb=1e-6, overlap=overlap),
    )
    assert len(optimizer.buckets) == 3
    for step in range(6):
        optimizer.zero_grad()
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + step))
        hidden = layers[0](x)
        if not (rank == 1 and step in (2, 3)):  # data-dependent: a skipped expert or layer-drop
            hidden = hidden + torch.tanh(layers[1](hidden))
        layers[2](hidden).square().mean().backward()
        optimizer.step()
    optimizer.wait_for_exchanges()
    optimizer.step()  # mix the last exchange in
    return torch.cat([p.detach().reshape(-1) for p in layers.parameters()])


@pytest.mark.timeout(180)
def test_backward_mode_keeps_bucket_order_when_a_rank_skips_a_parameter() -> None:
    # Rank 1's first and last buckets are ready during backward while the middle one is not; started
    # out of order, the ranks' sums of equal-sized buckets would pair different buckets, silently.
    step_mode = run_distributed(skipping_worker, 2, "step", timeout_s=120)
    backward_mode = run_distributed(skipping_worker, 2, "backward", timeout_s=120)
    for ours, reference in zip(backward_mode, step_mode, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def failing_peer_worker(rank: int, world_size: int, failure: str, topology: str) -> tuple[str, float]:
    """Rank 1 dies (or stalls) after 3 steps; rank 0 must stop with a clear error, not hang."""
    model = make_model(0)
    optimizer = DecentralizedAdam(
        model.parameters(),
        setting=Setting(topology=topology, intra_node="gossip"),  # every rank a worker, as on one node
        comm=Comm(local_world_size=2, timeout=3.0, bucket_size_mb=1e-4),
    )
    for step in range(1000):
        if rank == 1 and step == 3:
            if failure == "dies":
                os._exit(17)
            time.sleep(120)
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        started = time.monotonic()
        try:
            optimizer.step()
        except RuntimeError as error:
            return str(error), time.monotonic() - started
    return "no error", 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failure", ["dies", "stalls"])
@pytest.mark.parametrize(("topology", "world_size"), [("complete", 2), ("aer", 4)])
def test_a_failed_peer_stops_the_others_with_a_clear_error(
    failure: str, topology: str, world_size: int
) -> None:
    results = run_distributed(
        failing_peer_worker, world_size, failure, topology, allow_missing=frozenset({1})
    )
    message, seconds = results[0]
    assert "a peer process probably died or stalled" in message, message
    assert "ranks (0, 1" in message
    assert seconds < 3.0 + 5.0, f"rank 0 took {seconds:.1f} s to notice (timeout 3 s)"


def gloo_workers() -> int:
    """Threads that run process groups' gloo collectives (and hold each one's buffers while they do)."""
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    return names.count("pt_gloo_runloop")


def exit_worker(rank: int, world_size: int, topology: str) -> dict[str, Any]:
    """What the exit handler does: wait for the exchange in flight, then end the groups' threads."""
    from decentadam import shutdown

    torch.distributed.barrier()  # the default group starts its workers at its first collective
    before = gloo_workers()
    model = make_model(0)
    optimizer = DecentralizedAdam(
        model.parameters(),
        setting=Setting(topology=topology, intra_node="gossip"),
        comm=Comm(local_world_size=2),
    )
    deadline = time.monotonic() + 30.0  # a new thread, too, is listed a moment after it started
    while (during := gloo_workers()) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    for step in range(3):
        optimizer.zero_grad()
        loss_of(model, rank, step).backward()
        optimizer.step()
    assert isinstance(optimizer.communicator, ProcessGroupCommunicator)
    in_flight = optimizer.communicator.in_flight
    shutdown.close_all()
    # A joined thread leaves /proc/self/task a moment after pthread_join returns (the kernel wakes the
    # joiner before it unlists the task), so on busy cores give the count some seconds to settle.
    deadline = time.monotonic() + 30.0
    while (after := gloo_workers()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    loss_of(model, rank, 3).backward()
    try:
        optimizer.step()
        error = "no error"
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"before": before, "during": during, "after": after, "in_flight": in_flight, "error": error}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("topology", "world_size"), [("complete", 2), ("aer", 4)])
def test_exit_waits_for_exchanges_and_ends_their_threads(topology: str, world_size: int) -> None:
    # A gloo worker that lets go of a finished exchange during interpreter shutdown aborts the process;
    # the exit handler must join those threads first: the thread count returns to what it was.
    for result in run_distributed(exit_worker, world_size, topology):
        assert result["in_flight"] >= 1, result
        assert result["during"] > result["before"], result
        assert result["after"] == result["before"], result
        assert result["error"].startswith("ExchangeGroupsReleased: the exchange groups were released"), result


def close_worker(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """close(), or leaving a with block, waits for the exchange in flight and ends its groups' threads."""
    from decentadam import shutdown

    torch.distributed.barrier()  # the default group starts its workers at its first collective
    before = gloo_workers()
    model = make_model(0)

    def train(optimizer: DecentralizedAdam) -> int:
        for step in range(3):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            optimizer.step()
        assert isinstance(optimizer.communicator, ProcessGroupCommunicator)
        return optimizer.communicator.in_flight

    if how == "with":
        with DecentralizedAdam(
            model.parameters(), setting=Setting(topology="aer"), comm=Comm(local_world_size=2)
        ) as optimizer:
            in_flight = train(optimizer)
    else:
        optimizer = DecentralizedAdam(
            model.parameters(),
            setting=Setting(topology="aer"),
            comm=Comm(local_world_size=2, overlap="backward"),
        )
        in_flight = train(optimizer)
        optimizer.close()
        optimizer.close()  # idempotent
    deadline = time.monotonic() + 30.0  # joined threads leave /proc a moment later (see exit_worker)
    while (after := gloo_workers()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(optimizer.communicator, ProcessGroupCommunicator)
    loss_of(model, rank, 3).backward()  # no hook fires: close() detached them
    try:
        optimizer.step()
        error = "no error"
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {
        "in_flight": in_flight,
        "in_flight_after": optimizer.communicator.in_flight,
        "open": shutdown.open_count(),
        "before": before,
        "after": after,
        "error": error,
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["close", "with"])
def test_close_waits_for_exchanges_and_releases_the_groups(how: str) -> None:
    for result in run_distributed(close_worker, 4, how):
        assert result["in_flight"] >= 1, result
        assert result["in_flight_after"] == 0 and result["open"] == 0, result
        assert result["after"] == result["before"], result
        assert result["error"].startswith("ExchangeGroupsReleased: the exchange groups were released"), result


def test_close_in_one_process_stops_stepping() -> None:
    model = make_model(0)
    with DecentralizedAdam(model.parameters(), lr=LR) as optimizer:
        loss_of(model, 0, 0).backward()
        optimizer.step()
    with pytest.raises(RuntimeError, match="released by close"):
        optimizer.step()


def test_local_update_replaces_the_adamw_update() -> None:
    model = make_model(0)
    start = flat(model).clone()
    seen: list[int] = []

    def count(state: dict[Any, Any], group: dict[str, Any], params: list[torch.Tensor], source: Any) -> None:
        seen.append(len(params))

    optimizer = DecentralizedAdam(
        model.parameters(), lr=LR, comm=Comm(local_update=count, bucket_size_mb=1e-4)
    )
    for step in range(2):
        optimizer.zero_grad()
        loss_of(model, 0, step).backward()
        optimizer.step()
    assert seen and sum(seen) == 2 * len(list(model.parameters()))  # every parameter, once per step
    assert torch.equal(flat(model), start) and not optimizer.state  # nothing updated, no Adam state


def test_comm_stats_count_this_process_steps_and_snapshot_copies() -> None:
    model = make_model(0)
    optimizer = DecentralizedAdam(model.parameters(), lr=LR)
    snapshot = optimizer.stats.snapshot()
    for step in range(3):
        loss_of(model, 0, step).backward()
        optimizer.step()
    assert (optimizer.stats.steps, snapshot.steps) == (3, 0)
    optimizer.load_state_dict(
        {**optimizer.state_dict(), "decentralized": {**optimizer.state_dict()["decentralized"], "step": 10}}
    )
    assert (optimizer.step_count, optimizer.stats.steps) == (10, 3)


@pytest.mark.parametrize(
    ("saved_step", "saved_sync", "now_sync", "exchanges"),
    [
        (200, 300, 300, False),  # saved inside the warm-up: nothing was in flight
        (300, 300, 300, False),  # its last step mixed before returning
        (301, 300, 300, True),  # overlapped: x(t) was in flight and is sent again
        (400, 0, 500, True),  # what the state was saved with decides, not the new warm-up
        (200, 300, 0, False),
    ],
)
def test_a_resume_exchanges_again_only_what_was_in_flight(
    saved_step: int, saved_sync: int, now_sync: int, exchanges: bool
) -> None:
    """The parameters of a step inside the synchronous warm-up were mixed before step() returned,
    so a resume there sends no exchange first; after it, x(t) is exchanged again (bitwise resume,
    tested in test_matches_simulation_of_n_workers with "resume:sync20:step")."""
    optimizer = DecentralizedAdam(
        nn.Linear(2, 2).parameters(),
        setting=Setting(topology="complete", sync_steps=now_sync),
        comm=Comm(communicator=SimulatedCluster(2).communicator(0)),
    )
    state = optimizer.state_dict()
    state["decentralized"].update(step=saved_step, sync_steps=saved_sync)
    optimizer.load_state_dict(state)
    assert optimizer._sync_before_next_step is exchanges


def test_launched_without_process_group_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="not initialised"):
        DecentralizedAdam(nn.Linear(2, 2).parameters())
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer"):
        DecentralizedAdam(nn.Linear(2, 2).parameters())


@pytest.mark.parametrize("second_moment", ["all_ranks", "group_gradient:1", "all_ranks+bf16"])
def test_single_process_equals_adamw(second_moment: str) -> None:
    model, reference = make_model(0), make_model(0)
    ours = DecentralizedAdam(
        model.parameters(),
        lr=LR,
        weight_decay=WD,
        accum_steps=1,
        setting=make_setting(topology="aer", **second_moment_args(second_moment)),
    )
    theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    for step in range(20):
        for m, opt in ((model, ours), (reference, theirs)):
            opt.zero_grad()
            loss_of(m, 0, step).backward()
            opt.step()
    torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=1e-14)


def test_backward_overlap_rejects_two_backwards_per_step() -> None:
    model = make_model(0)
    optimizer = DecentralizedAdam(model.parameters(), comm=Comm(overlap="backward"))
    optimizer.zero_grad()
    loss_of(model, 0, 0).backward()  # the first iteration calibrates hook counts
    optimizer.step()
    optimizer.zero_grad()
    loss_of(model, 0, 1).backward()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        loss_of(model, 0, 2).backward()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr"),
        ({"accum_steps": 0}, "accum_steps"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"bucket_size_mb": 0}, "bucket_size_mb"),
        ({"overlap": "sometimes"}, "overlap"),
        ({"topology": "star"}, "unknown topology"),
        ({"second_moment": "nodes"}, "second_moment must be one of 'all_ranks', 'local', 'group_gradient', "),
        ({"second_moment": "group_gradient", "v_every": 0}, r"v_every must be an integer >= 1 .* got 0"),
        ({"v_every": 2}, r"v_every=2 .* but second_moment='global': pass second_moment='group_gradient'"),
        ({"second_moment": "local", "v_every": 1}, r"but second_moment='local'"),
        (
            {"second_moment": "group_gradient", "accum_steps": 2},
            r"accum_steps=2 is the accumulation window .* use setting='accumadam'",
        ),
        ({"intra_node": "node"}, r"intra_node must be 'gossip' or 'all_reduce', got 'node'"),
        ({"exchange": "fp8"}, r"exchange must be 'parameters' or 'bf16_updates', got 'fp8'"),
        (
            {"intra_node": "all_reduce", "second_moment": "group_gradient", "v_every": 2},
            r"v_every=2: with intra_node='all_reduce' the node's gradients .* leave v_every out",
        ),
        (
            {"intra_node": "all_reduce", "second_moment": "group_gradient", "share_second_moment_every": -1},
            r"share_second_moment_every must be an integer >= 0 .* got -1: use 2",
        ),
        (
            {"intra_node": "gossip", "second_moment": "group_gradient", "share_second_moment_every": 2},
            r"share_second_moment_every=2 shares the nodes' .* intra_node='gossip': pass intra_node=",
        ),
        (
            {"sync_steps": -1},
            r"sync_steps must be an integer >= 0 .* got -1: use the learning rate's warm-up",
        ),
        (
            {"intra_node": "all_reduce", "share_second_moment_every": 2},
            r"but second_moment='global': pass intra_node='all_reduce', second_moment='group_gradient' "
            r".* or leave it out",
        ),
        ({"average_every": -2}, r"average_every must be an integer >= 0 .* got -2"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        built(nn.Linear(2, 2).parameters(), **kwargs)


def test_the_global_second_moment_needs_exact_averages() -> None:
    communicator = SimulatedCluster(4).communicator(0)
    match = r"second_moment='global' averages .* has none: pass average_every=k"
    with pytest.raises(ValueError, match=match):
        DecentralizedAdam(
            nn.Linear(2, 2).parameters(),
            setting=Setting(topology="aer", exchange="parameters", average_every=0, second_moment="global"),
            comm=Comm(communicator=communicator),
        )


@pytest.mark.parametrize(
    ("kwargs", "every"),
    [
        ({"intra_node": "all_reduce", "second_moment": "group_gradient"}, 0),  # off by default
        ({"intra_node": "all_reduce", "second_moment": "group_gradient", "share_second_moment_every": 2}, 2),
        ({"intra_node": "all_reduce", "second_moment": "all_ranks"}, 0),  # no A to share
        ({"intra_node": "gossip", "second_moment": "group_gradient", "share_second_moment_every": 0}, 0),
    ],
)
def test_the_nodes_keep_their_own_second_moment_by_default(kwargs: dict[str, Any], every: int) -> None:
    """share_second_moment_every is 0 unless given: each node keeps its own A and the floor V / N (2
    nodes x 2 here); k = 2 with the nodes' group_gradient estimate lowers the floor to V / N**2."""
    communicator = SimulatedCluster(4).communicator(0)
    optimizer = built(nn.Linear(2, 2).parameters(), local_world_size=2, communicator=communicator, **kwargs)
    assert optimizer.setting.share_every == every
    source = optimizer.moment_source
    nodes = 2 if kwargs.get("intra_node") == "all_reduce" else 4
    assert source.noise_ranks == nodes and source.floor_ranks == (nodes**2 if every else None)
    assert all(set(g) <= {"params", *optimizer.defaults} for g in optimizer.param_groups)
    assert optimizer.state_dict()["decentralized"]["share_second_moment_every"] == every


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"second_moment": "group_gradient", "local_world_size": 1},
            r"from the gradients of a node's ranks, but local_world_size is 1: give the ranks per node",
        ),
        ({"local_world_size": 3}, r"world_size to be a multiple of local_world_size, got 4 and 3"),
        (
            {"topology": build("ring", 4), "local_world_size": 2},
            r"schedules the 2 nodes of 2 ranks: build it for 2",
        ),
    ],
)
def test_bad_node_arguments_name_the_problem(kwargs: dict[str, Any], match: str) -> None:
    communicator = SimulatedCluster(4).communicator(0)
    with pytest.raises(ValueError, match=match):
        built(nn.Linear(2, 2).parameters(), intra_node="all_reduce", communicator=communicator, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"topology": "one-peer-exp", "intra_node": "gossip"},
            r"topology 'one-peer-exp' gives rank 0 2 different groups",
        ),
        (
            {"topology": "ring", "intra_node": "gossip"},
            r"topology 'ring' gives rank 0 2 different groups .* never averages all ranks, where that point "
            r"would be renewed: pass average_every=k",
        ),
        (
            {"topology": "aer", "intra_node": "all_reduce", "local_world_size": 1},
            r"topology 'aer' over the nodes gives rank 0 2 different groups",
        ),
    ],
)
def test_bf16_updates_need_one_fixed_group_per_rank(kwargs: dict[str, Any], match: str) -> None:
    communicator = SimulatedCluster(4).communicator(0)
    with pytest.raises(ValueError, match=match):
        built(
            nn.Linear(2, 2).parameters(),
            exchange="bf16_updates",
            average_every=0,
            communicator=communicator,
            **kwargs,
        )


def test_one_rank_with_node_averaged_gradients_is_adamw() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    reference = copy.deepcopy(model)
    optimizer = DecentralizedAdam(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        setting=Setting(second_moment="group_gradient", intra_node="all_reduce"),
        comm=Comm(local_world_size=2),
    )
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(5):
        for m, o in ((model, optimizer), (reference, adamw)):
            o.zero_grad()
            x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            m(x).square().mean().backward()
            o.step()
    torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=1e-14)


def test_the_default_in_one_process_is_adamw() -> None:
    """n = 1: ``DecentralizedAdam(params, lr)`` with nothing else is AdamW, for 70 steps (a single rank
    has nothing to average: no exact averages, no shared second moment)."""
    model, reference = make_model(0), make_model(0)
    ours = DecentralizedAdam(param_groups(model), lr=LR, betas=BETAS, eps=EPS)
    theirs = torch.optim.AdamW(param_groups(reference), lr=LR, betas=BETAS, eps=EPS)
    for step in range(70):
        for m, opt in ((model, ours), (reference, theirs)):
            opt.zero_grad()
            loss_of(m, 0, step).backward()
            opt.step()
    torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=1e-13)


def test_the_default_on_one_node_is_adamw_on_the_node_s_mean_gradient() -> None:
    """4 simulated ranks on one node (``local_world_size=4``) with the default: every rank steps
    with the node's mean gradient and stays AdamW on it (DDP's run) for 40 steps."""
    world_size, steps = 4, 40
    models, optimizers = run_simulated(None, world_size, world_size, steps)
    reference = make_model(seed=100)
    adamw = torch.optim.AdamW(param_groups(reference), lr=LR, betas=BETAS, eps=EPS)
    for step in range(steps):
        adamw.zero_grad()
        (sum(loss_of(reference, rank, step) for rank in range(world_size)) / world_size).backward()
        adamw.step()
    for model in models:
        torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=1e-12)
    numel = flat(reference).numel()
    for model, optimizer in zip(models, optimizers, strict=True):
        # the replicas exchange nothing but the gradient sums, and keep no bf16 reference point
        assert optimizer.topology.name == "one-peer-exp" and optimizer.stats.bytes_sent == steps * numel * 8
        assert all("exchange_ref" not in optimizer.state[p] for p in model.parameters())
        optimizer.close()


def test_loading_state_saved_with_another_second_moment_warns(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(2, 2)
    saved = DecentralizedAdam(
        model.parameters(),
        setting=make_setting(intra_node="gossip", second_moment="group_gradient", v_every=2),
    )
    model(torch.ones(1, 2)).sum().backward()
    saved.step()
    loading = DecentralizedAdam(
        model.parameters(),
        setting=make_setting(intra_node="gossip", second_moment="group_gradient", v_every=1),
    )
    with caplog.at_level(logging.WARNING, logger="decentadam.optimizer_state"):
        loading.load_state_dict(saved.state_dict())
    saved_with = "second_moment='group_gradient', v_every=2, intra_node='gossip', share_second_moment_every=0"
    assert f"{saved_with}; continuing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="decentadam.optimizer_state"):
        saved.load_state_dict(saved.state_dict())
    assert caplog.text == ""


def run_with_late_parameter(overlap: str) -> torch.Tensor:
    """The second layer gets no gradient in the first iteration (the one that counts the hooks)."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    optimizer = DecentralizedAdam(
        [*first.parameters(), *second.parameters()],
        lr=LR,
        accum_steps=2,
        setting=Setting(second_moment="local"),
        comm=Comm(overlap=overlap),
    )
    for step in range(5):
        optimizer.zero_grad()
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        out = first(x) if step == 0 else second(torch.tanh(first(x)))
        out.square().mean().backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in [*first.parameters(), *second.parameters()]])


def test_backward_mode_with_a_parameter_unused_in_the_first_iteration_equals_step_mode() -> None:
    # its bucket's hook count is unknown, so step() updates it: no partial step, no false error
    torch.testing.assert_close(
        run_with_late_parameter("backward"), run_with_late_parameter("step"), rtol=0, atol=0
    )


def test_remove_hooks_between_backward_and_step_is_refused() -> None:
    model = make_model(0)
    optimizer = DecentralizedAdam(model.parameters(), comm=Comm(overlap="backward"))
    for step in range(2):  # the second iteration's hooks step the buckets during backward
        optimizer.zero_grad()
        loss_of(model, 0, step).backward()
        if step == 1:
            with pytest.raises(RuntimeError, match=r"call it after step\(\)"):
                optimizer.remove_hooks()
        optimizer.step()
    optimizer.remove_hooks()
    assert optimizer.overlap == "step"
    state_steps = optimizer.state[next(model.parameters())]["step"].item()
    optimizer.zero_grad()
    loss_of(model, 0, 2).backward()
    optimizer.step()
    assert optimizer.state[next(model.parameters())]["step"].item() == state_steps + 1  # one update


def test_parameters_added_or_unfrozen_after_construction_are_refused() -> None:
    trained, frozen = nn.Linear(2, 2), nn.Linear(2, 2)
    frozen.requires_grad_(False)
    optimizer = DecentralizedAdam([*trained.parameters(), *frozen.parameters()])
    with pytest.raises(RuntimeError, match=r"add_param_group\(\) after construction"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    frozen.requires_grad_(True)  # progressive unfreezing: this optimizer never bucketed it
    (trained(torch.ones(1, 2)) + frozen(torch.ones(1, 2))).sum().backward()
    with pytest.raises(RuntimeError, match=r"frozen \(requires_grad=False\) when the optimizer was built"):
        optimizer.step()


def test_group_gradient_state_round_trips_with_the_sum_in_flight_folded_in() -> None:
    """A and u are optimizer state; state_dict() first waits for the gradient sum in flight and folds
    it in, once: the next step does not fold it again."""
    from decentadam.simulation import SimulatedCluster

    def build(cluster: SimulatedCluster, models: list[nn.Module]) -> list[DecentralizedAdam]:
        return [
            DecentralizedAdam(
                m.parameters(),
                lr=LR,
                setting=make_setting(
                    topology="complete", intra_node="gossip", second_moment="group_gradient", v_every=1
                ),
                comm=Comm(communicator=cluster.communicator(rank)),
            )
            for rank, m in enumerate(models)
        ]

    models = [make_model(0) for _ in range(2)]
    optimizers = build(SimulatedCluster(2), models)
    for step in range(3):  # the sums of steps 0 and 1 arrive at steps 1 and 2; step 2's is in flight
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
        for optimizer in optimizers:
            optimizer.step()
    saved = [copy.deepcopy(o.state_dict()) for o in optimizers]
    assert saved[0]["decentralized"]["v_every"] == 1
    assert {s["group_updates"] for s in saved[0]["state"].values()} == {3}
    fresh = build(SimulatedCluster(2), [make_model(1) for _ in range(2)])
    for optimizer, state in zip(fresh, saved, strict=True):
        optimizer.load_state_dict(copy.deepcopy(state))
        again = optimizer.state_dict()
        for key, values in state["state"].items():
            assert again["state"][key].keys() == values.keys()
            for name, value in values.items():
                assert torch.equal(torch.as_tensor(again["state"][key][name]), torch.as_tensor(value)), name
    for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
        optimizer.zero_grad()
        loss_of(model, rank, 3).backward()
    for optimizer in optimizers:
        optimizer.step()  # nothing left to fold: step 3's gradients are the next sum
    assert {s["group_updates"] for s in optimizers[0].state.values()} == {3}


def test_a_state_saved_with_second_moment_keys_in_its_groups_loads_without_them() -> None:
    """States of earlier versions carried the second moment's source as param-group keys; loading
    drops them: the groups keep torch's and the user's keys only, and the steps are the same."""
    communicator = SimulatedCluster(2).communicator(0)
    model = make_model(0)
    optimizer = DecentralizedAdam(param_groups(model), lr=LR, comm=Comm(communicator=communicator))
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group.update(noise_ranks=2, v_every=1, floor_ranks=4)
    optimizer.load_state_dict(state)
    assert all(set(g) <= {"params", *optimizer.defaults} for g in optimizer.param_groups)
    assert not {"noise_ranks", "v_every", "floor_ranks"} & set(optimizer.defaults)
    assert optimizer.moment_source.noise_ranks == 2
