"""SimulatedCluster: n DecentralizedAdam optimizers in one process == the independent simulation.

tests/test_decentralized.py shows that real gloo runs equal ``simulate`` (mixing matrices plus the
AccumAdamW formula written out) to 1e-10; here the in-memory exchanges must meet the same bar, so
the simulated cluster runs what n processes would.
"""

from __future__ import annotations

import pytest
import torch

from decentadam import Comm, DecentralizedAdam, Setting, make_setting
from decentadam.simulation import SimulatedCluster
from tests.test_decentralized import (
    BETAS,
    CONFIGS_4,
    CONFIGS_8,
    EPS,
    LR,
    STEPS,
    Config,
    flat,
    loss_of,
    make_model,
    param_groups,
    parse_topology,
    second_moment_args,
    simulate,
    sync_of,
)


def run_simulated(
    world_size: int, name: str, local_world_size: int, accum_steps: int, overlap: str, second_moment: str
) -> tuple[torch.Tensor, list[DecentralizedAdam], list[torch.nn.Module]]:
    sync_steps = sync_of(overlap)  # steps that wait for their own exchange: every rank in a thread
    cluster = SimulatedCluster(world_size, concurrent=bool(sync_steps), timeout=60)
    models = [make_model(seed=100 + rank) for rank in range(world_size)]  # rank 0's weights must win
    name, average_every = parse_topology(name)
    optimizers = [
        DecentralizedAdam(
            param_groups(model),
            lr=LR,
            betas=BETAS,
            eps=EPS,
            accum_steps=accum_steps,
            setting=make_setting(
                **second_moment_args(second_moment),
                topology=name,
                average_every=average_every,
                sync_steps=sync_steps,
            ),
            comm=Comm(
                local_world_size=local_world_size,
                bucket_size_mb=1e-4,
                overlap=overlap.split(":")[-1],  # type: ignore[arg-type]
                communicator=cluster.communicator(rank),
            ),
        )
        for rank, model in enumerate(models)
    ]
    for step in range(STEPS):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
        for optimizer in optimizers:  # intra_node="all_reduce": every node's sum started before a rank waits
            optimizer.start_gradient_sums()
        if cluster.concurrent:
            cluster.run([optimizer.step for optimizer in optimizers])
        else:
            for optimizer in optimizers:
                optimizer.step()
    return torch.stack([flat(m) for m in models]), optimizers, models


# Resumes are left out: a resumed rank's first step exchanges its weights and waits for them at once
# (a concurrent cluster could run it, but the rebuild is the gloo tests' business); so are the
# node-averaged gradients in backward mode, which each bucket's hook sums and waits for. Synchronous
# steps ("syncW:") run every rank's step in its own thread (SimulatedCluster(concurrent=True)).
CONFIGS = [
    (n, c)
    for n, configs in ((4, CONFIGS_4), (8, CONFIGS_8))
    for c in configs
    if not c[3].startswith(("resume:", "reload:")) and not (c[4].startswith("node+") and "backward" in c[3])
]


@pytest.mark.parametrize(("world_size", "config"), CONFIGS, ids=str)
def test_simulated_cluster_matches_the_independent_simulation(world_size: int, config: Config) -> None:
    name, local_world_size, accum_steps, _, second_moment = config
    got, optimizers, models = run_simulated(world_size, *config)
    expected = simulate(name, world_size, local_world_size, accum_steps, second_moment, sync_of(config[3]))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    per_rank = [list(m.parameters()) for m in models]
    mean = torch.cat([t.reshape(-1) for t in SimulatedCluster.average(per_rank)])
    torch.testing.assert_close(mean, expected.mean(0), rtol=0, atol=1e-12)
    distance = (expected - expected.mean(0)).square().sum(1).mean().item()
    assert SimulatedCluster.consensus_distance(per_rank) == pytest.approx(distance, rel=1e-8, abs=1e-14)
    if name != "complete":
        assert distance > 0
    assert all(o.stats.exchanges > 0 for o in optimizers)
    # group_gradient's A replaces the noise estimate S: a rank keeps S only until its first A
    # (never with nodes, whose A comes before the first step; after k steps with the gossip's sums)
    kept = {"noise_sq" in st for o in optimizers for st in o.state.values()}
    corrected = second_moment.removeprefix("node+").startswith(("all_ranks", "group_gradient", "global"))
    node_ranks = local_world_size if second_moment.startswith("node+") else 1
    if "group_gradient" in second_moment or not corrected or world_size == node_ranks:
        assert kept == {False}, config
    else:
        assert kept == {True}, config


def test_waiting_for_an_exchange_a_member_has_not_started_names_the_ranks() -> None:
    cluster = SimulatedCluster(2)
    models = [make_model(seed=1) for _ in range(2)]
    optimizers = [
        DecentralizedAdam(
            m.parameters(),
            setting=Setting(topology="complete"),
            comm=Comm(communicator=cluster.communicator(r)),
        )
        for r, m in enumerate(models)
    ]
    for rank, model in enumerate(models):
        loss_of(model, rank, 0).backward()
    optimizers[0].step()  # starts the exchange of step 1; rank 1 has not
    loss_of(models[0], 0, 1).backward()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] have not started it"):
        optimizers[0].step()


def test_world_collectives_point_to_the_cluster_helpers() -> None:
    cluster = SimulatedCluster(2)
    models = [make_model(seed=1) for _ in range(2)]
    optimizer = DecentralizedAdam(
        models[0].parameters(),
        setting=Setting(topology="complete"),
        comm=Comm(communicator=cluster.communicator(0)),
    )
    with pytest.raises(RuntimeError, match=r"SimulatedCluster\.average"):
        optimizer.consensus_distance()


def test_a_rank_built_before_rank_0_cannot_receive_its_weights() -> None:
    cluster = SimulatedCluster(2)
    with pytest.raises(RuntimeError, match=r"build \(or step\) rank 0 first"):
        DecentralizedAdam(
            make_model(seed=1).parameters(),
            setting=Setting(topology="ring"),
            comm=Comm(communicator=cluster.communicator(1)),
        )


def test_node_averaged_gradients_need_every_rank_to_start_its_sums_first() -> None:
    cluster = SimulatedCluster(2)
    models = [make_model(seed=1) for _ in range(2)]
    optimizers = [
        DecentralizedAdam(
            m.parameters(),
            setting=Setting(intra_node="all_reduce"),
            comm=Comm(local_world_size=2, communicator=cluster.communicator(r)),
        )
        for r, m in enumerate(models)
    ]
    for rank, model in enumerate(models):
        loss_of(model, rank, 0).backward()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] have not started it"):
        optimizers[0].step()  # waits for its node's sum, which rank 1 starts in its own step
