"""The runtime model's formulas against hand-computed cases, limits, monotonicity and its CLI."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from decentadam.runtime_model import (
    ALLREDUCE,
    METHODS,
    Cluster,
    Workload,
    group_phase_times,
    group_sum_times,
    main,
    parse_size,
    predict,
    predict_all,
    ring_edges,
)
from decentadam.topology import build

S = 100e6  # bytes
GBIT = 1e9 / 8  # bytes/s


def _cluster(nodes: int = 4, local: int = 2, inter: float = GBIT, intra: float = 1e12) -> Cluster:
    return Cluster(nodes=nodes, ranks_per_node=local, inter_bytes_per_s=inter, intra_bytes_per_s=intra)


def test_ring_edges_visit_members_in_order() -> None:
    assert ring_edges((0,)) == []
    assert ring_edges((1, 3)) == [(1, 3), (3, 1)]
    assert ring_edges((0, 1, 2, 3)) == [(0, 1), (1, 2), (2, 3), (3, 0)]


def test_all_reduce_puts_2_n_minus_1_over_n_on_each_node_link() -> None:
    world = tuple(range(8))
    seconds = group_sum_times([world], _cluster(), S)[world]
    assert seconds == pytest.approx(2 * 7 / 8 * S / GBIT)  # 1.4 s at 1 Gbit/s


def test_pair_across_nodes_sends_the_model_once_each_way() -> None:
    times = group_sum_times([(0, 2), (1, 3), (4, 6), (5, 7)], _cluster(), S)
    # two pairs leave node 0 at once (0->2 and 1->3): the link carries 2 S
    assert times[(0, 2)] == pytest.approx(2 * S / GBIT)
    times = group_sum_times([(0, 4), (1, 5), (2, 6), (3, 7)], _cluster(nodes=8, local=1), S)
    assert times[(0, 4)] == pytest.approx(S / GBIT)  # one rank per node: S each way
    # ring's odd round on 4 x 2: rank 1 -> 2 and rank 0 -> 7 both leave node 0
    times = group_sum_times([(0, 7), (1, 2), (3, 4), (5, 6)], _cluster(), S)
    assert times[(1, 2)] == pytest.approx(2 * S / GBIT)


def test_aer_inter_node_group_is_a_ring_of_2L_ranks() -> None:
    groups = [(0, 1, 2, 3), (4, 5), (6, 7)]
    times = group_sum_times(groups, _cluster(intra=10 * GBIT), S)
    assert times[(0, 1, 2, 3)] == pytest.approx(2 * 3 / 4 * S / GBIT)  # 1.5 S over the node link
    assert times[(4, 5)] == pytest.approx(S / (10 * GBIT))  # intra-node pair
    assert times[(0, 1, 2, 3)] > times[(4, 5)]


def test_hierarchical_aer_group_puts_S_on_the_node_link_in_three_phases() -> None:
    groups = [(0, 1, 2, 3), (4, 5), (6, 7)]
    cluster = _cluster(intra=10 * GBIT)
    phases = group_phase_times(groups, cluster, S, hierarchical=True)
    # reduce-scatter of S over 2 ranks (S/2 per edge), rails 0<->2 and 1<->3 with S/2 each (the node
    # link carries both: S per direction), all-gather as the reduce-scatter
    assert phases[(0, 1, 2, 3)] == pytest.approx((S / 2 / (10 * GBIT), S / GBIT, S / 2 / (10 * GBIT)))
    assert phases[(4, 5)] == pytest.approx((S / (10 * GBIT),))  # one node: a plain all-reduce
    total = group_sum_times(groups, cluster, S, hierarchical=True)[(0, 1, 2, 3)]
    assert total == pytest.approx(S / GBIT + S / (10 * GBIT))
    assert total < group_sum_times(groups, cluster, S)[(0, 1, 2, 3)]  # the flat ring's 1.5 S


def test_hierarchical_complete_uses_rails_of_all_nodes() -> None:
    world = tuple(range(8))
    phases = group_phase_times([world], _cluster(intra=1e15), S, hierarchical=True)[world]
    # 2 rails of 4 nodes, each 2 * 3/4 * S/2 per edge: 1.5 S per node link instead of 1.75 S
    assert phases[1] == pytest.approx(1.5 * S / GBIT)
    assert phases[0] == phases[2] == pytest.approx(0.0, abs=1e-6)


def test_hierarchical_buckets_pipeline_behind_the_slowest_phase() -> None:
    # 2 nodes x 2, nothing but communication: the rail (S at 1 Gbit/s, 0.8 s) sets the pace; the
    # intra-node phases of one bucket hide behind the rail traffic of the others
    cluster = _cluster(nodes=2, intra=10 * GBIT)
    work = Workload(param_bytes=S, compute_s=0.0, hierarchical=True)
    assert predict("complete", cluster, work).iteration_s == pytest.approx(S / GBIT, rel=1e-6)
    flat = predict("complete", cluster, replace(work, hierarchical=False)).iteration_s
    assert flat == pytest.approx(1.5 * S / GBIT, rel=1e-6)


def test_hierarchical_traffic_and_all_reduce_unchanged() -> None:
    cluster = _cluster()
    work = Workload(param_bytes=S, compute_s=0.1, hierarchical=True)
    aer = predict("aer", cluster, work)
    # each rank spends 2 of AER's 4 steps in a two-node group and sends S/2 across nodes there
    assert aer.inter_bytes_per_rank == pytest.approx(S / 4)
    assert predict("aer", cluster, replace(work, hierarchical=False)).inter_bytes_per_rank == pytest.approx(
        1.5 * S / 4
    )
    # DDP's All-Reduce is torch's own: the flag does not touch it
    assert predict(ALLREDUCE, cluster, work) == predict(ALLREDUCE, cluster, replace(work, hierarchical=False))


def test_latency_adds_two_g_minus_one_messages() -> None:
    cluster = Cluster(4, 2, inter_bytes_per_s=GBIT, intra_bytes_per_s=1e12, inter_latency_s=1e-3)
    world = tuple(range(8))
    assert group_sum_times([world], cluster, S)[world] == pytest.approx(1.4 + 14e-3)


def test_compute_bound_limit_is_compute_plus_update() -> None:
    fast = _cluster(inter=1e15, intra=1e15)
    work = Workload(param_bytes=S, compute_s=0.1, update_s=0.02, allreduce_update_s=0.03)
    for method in METHODS:
        expected = 0.13 if method == ALLREDUCE else 0.12
        assert predict(method, fast, work).iteration_s == pytest.approx(expected, rel=1e-6), method


def test_communication_bound_limits() -> None:
    work = Workload(param_bytes=S, compute_s=0.0)
    cluster = _cluster()
    assert predict("complete", cluster, work).iteration_s == pytest.approx(1.4)
    assert predict(ALLREDUCE, cluster, work).iteration_s == pytest.approx(1.4)
    # ring: intra-node pairs (free), then both ranks of a node pair across nodes (2 S / B): 0.8 s per step
    assert predict("ring", cluster, work).iteration_s == pytest.approx(0.8, rel=1e-3)


def test_all_reduce_overlaps_backward_only() -> None:
    # 1 bucket: the reduction starts at the end of backward, nothing overlaps
    work = Workload(param_bytes=S, compute_s=0.3, bucket_bytes=2 * S)
    assert predict(ALLREDUCE, _cluster(), work).iteration_s == pytest.approx(0.3 + 1.4)
    # many small buckets: f C + max((1 - f) C, comm) up to the first bucket
    work = Workload(param_bytes=S, compute_s=3.0, bucket_bytes=S / 1000)
    assert predict(ALLREDUCE, _cluster(), work).iteration_s == pytest.approx(3.0, rel=1e-2)


def test_gossip_overlaps_the_update_with_the_exchange_but_all_reduce_cannot() -> None:
    # comm-bound: complete topology = the same bytes as All-Reduce, 1.4 s per step on the link
    work = Workload(param_bytes=S, compute_s=0.0, update_s=0.4, allreduce_update_s=0.4, bucket_bytes=S / 4)
    # DDP steps only after the last bucket is reduced: comm + U
    assert predict(ALLREDUCE, _cluster(), work).iteration_s == pytest.approx(1.4 + 0.4)
    # gossip: bucket 0's exchange travels while buckets 1..3 are updated; the link stays busy and only
    # each bucket is updated (U/K = 0.1 s) while later ones still travel (T/K = 0.35 s): all hidden
    assert predict("complete", _cluster(), work).iteration_s == pytest.approx(1.4, rel=1e-3)
    # the cores that update also move the bytes: each exchange waits for the whole update
    serial = replace(work, update_overlaps_comm=False)
    assert predict("complete", _cluster(), serial).iteration_s == pytest.approx(1.4 + 0.4, rel=1e-3)
    # compute-bound: every bucket has arrived when backward ends: C + U
    fast = _cluster(inter=1e15, intra=1e15)
    assert predict("complete", fast, replace(work, compute_s=0.3)).iteration_s == pytest.approx(0.7)


def test_backward_overlap_updates_inside_backward() -> None:
    fast = _cluster(inter=1e15, intra=1e15)
    work = Workload(param_bytes=S, compute_s=0.3, update_s=0.4, bucket_bytes=S / 4, overlap="backward")
    # no communication to wait for: the hooks add their update to backward, C + U either way
    assert predict("aer", fast, work).iteration_s == pytest.approx(0.7)
    # comm-bound: the exchange of bucket k can start during backward, before the last layers ran
    slow = Workload(param_bytes=S, compute_s=0.3, update_s=0.0, bucket_bytes=S / 4)
    step_mode = predict("complete", _cluster(), slow).iteration_s
    backward_mode = predict("complete", _cluster(), replace(slow, overlap="backward")).iteration_s
    assert step_mode == pytest.approx(1.4, rel=1e-3) and backward_mode == pytest.approx(1.4, rel=1e-3)


def test_aer_alternation_hides_half_of_the_slow_link() -> None:
    work = Workload(param_bytes=S, compute_s=0.1)
    aer = predict("aer", _cluster(), work)
    # every node crosses the link in 2 of 4 steps (1.5 S / B each) and computes on the others
    assert aer.lower_bound_s == pytest.approx((1.2 + 0.1) / 2, rel=1e-3)
    assert aer.inter_bytes_per_rank == pytest.approx(1.5 * S / 4)
    assert aer.iteration_s < 0.5 * predict(ALLREDUCE, _cluster(), work).iteration_s


def test_persistent_straggler_sets_the_pace_of_every_connected_schedule() -> None:
    fast = _cluster(inter=1e15, intra=1e15)
    work = Workload(param_bytes=S, compute_s=0.1, compute_scale=(2.0,) + (1.0,) * 7)
    for method in METHODS:
        assert predict(method, fast, work).iteration_s == pytest.approx(0.2, rel=1e-3), method


@pytest.mark.parametrize("method", METHODS)
def test_monotone_in_bandwidth_size_and_compute(method: str) -> None:
    base = Workload(param_bytes=S, compute_s=0.1, update_s=0.01, allreduce_update_s=0.01)
    times = [predict(method, _cluster(inter=b * GBIT), base).iteration_s for b in (0.5, 1, 2, 10, 100)]
    assert times == sorted(times, reverse=True)
    sizes = [
        predict(method, _cluster(), Workload(param_bytes=s, compute_s=0.1)).iteration_s
        for s in (1e6, 1e7, 1e8, 1e9)
    ]
    assert sizes == sorted(sizes)
    computes = [
        predict(method, _cluster(), Workload(param_bytes=S, compute_s=c)).iteration_s for c in (0, 0.5, 2, 5)
    ]
    assert computes == sorted(computes)
    prediction = predict(method, _cluster(), base)
    assert prediction.lower_bound_s <= prediction.iteration_s


def test_single_rank_and_unbuildable_topologies() -> None:
    one = predict_all(_cluster(nodes=1, local=1), Workload(param_bytes=S, compute_s=0.1))
    assert {p.method for p in one} == set(METHODS)
    assert all(p.iteration_s == pytest.approx(0.1) for p in one)
    odd = predict_all(_cluster(nodes=3, local=1), Workload(param_bytes=S, compute_s=0.1))
    assert {p.method for p in odd} == {ALLREDUCE, "complete"}  # ring needs even n, exp/aer powers of two


def test_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        Cluster(0, 1, GBIT, GBIT)
    with pytest.raises(ValueError, match="inter_bytes_per_s must be > 0"):
        Cluster(1, 1, 0.0, GBIT)
    with pytest.raises(ValueError, match="overlap must be"):
        Workload(param_bytes=S, compute_s=0.1, overlap="later")
    with pytest.raises(ValueError, match="forward_fraction"):
        Workload(param_bytes=S, compute_s=0.1, forward_fraction=1.5)
    with pytest.raises(ValueError, match="compute_scale has 2 entries for 8 ranks"):
        predict("aer", _cluster(), Workload(param_bytes=S, compute_s=0.1, compute_scale=(1.0, 2.0)))


@pytest.mark.parametrize("v_every", [1, 2, 3])
def test_group_gradient_adds_its_bytes_every_k_steps(v_every: int) -> None:
    """A ring of pairs sends each exchange's bytes once: S per step, and G / k more with the gradient,
    G = 2 P (bfloat16) for a pair; a group of 4 sends 1.5 times its S + 4 P (float32)."""
    cluster = _cluster(nodes=4, local=1)
    plain = predict("ring", cluster, Workload(param_bytes=S, compute_s=0.01))
    work = Workload(param_bytes=S, compute_s=0.01, gradient_values=S / 4, v_every=v_every)
    ours = predict("ring", cluster, work)
    assert plain.sent_bytes_per_rank == pytest.approx(S)
    assert ours.sent_bytes_per_rank == pytest.approx(S + S / 2 / v_every)
    assert ours.iteration_s > plain.iteration_s  # communication-bound here
    everyone = predict("complete", cluster, work)
    assert everyone.sent_bytes_per_rank == pytest.approx(1.5 * (S + S / v_every))
    with pytest.raises(ValueError, match="v_every must be >= 1"):
        Workload(param_bytes=S, compute_s=0.1, gradient_values=S, v_every=0)


def test_bf16_updates_send_half_of_float32_parameters_across_the_nodes() -> None:
    """exchange="bf16_updates" over 2 nodes x 2 on complete: 2 P bytes every step where the
    parameters take 4 P; the same inter-node bytes as aer's float32 parameters every other step."""
    cluster = Cluster(2, 2, GBIT, 10 * GBIT, inter_latency_s=20e-6, intra_latency_s=5e-6)
    work = Workload(param_bytes=S, compute_s=0.01, intra_node="all_reduce", hierarchical=True)
    updates = replace(work, update_values=S / 4)  # S bytes of float32 parameters: S / 4 values
    complete = predict("complete", cluster, work)
    halved = predict("complete", cluster, updates)
    assert halved.inter_bytes_per_rank == pytest.approx(complete.inter_bytes_per_rank / 2)
    assert halved.inter_bytes_per_rank == pytest.approx(predict("aer", cluster, work).inter_bytes_per_rank)
    assert halved.node_sum_bytes_per_rank == pytest.approx(complete.node_sum_bytes_per_rank)
    assert halved.iteration_s < complete.iteration_s  # communication-bound here
    with pytest.raises(ValueError, match="update_values must be >= 0"):
        Workload(param_bytes=S, compute_s=0.1, update_values=-1.0)
    four = Cluster(4, 2, GBIT, 10 * GBIT)  # over 4 nodes only complete keeps one group per rank
    assert [p.method for p in predict_all(four, updates) if p.method != ALLREDUCE] == ["complete"]
    with pytest.raises(
        ValueError,
        match="needs one fixed group per rank or exact averages over all ranks; aer changes them and has",
    ):
        predict("aer", four, updates)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_shared_second_moment_adds_its_bfloat16_bytes_every_kth_exchange(every: int) -> None:
    """share_second_moment_every=k on complete over 2 nodes x 2 with bf16 updates: 2 P bytes of A
    every k-th step on top of the update's 2 P (3 bytes per parameter and step at k = 2, not 2)."""
    cluster = Cluster(2, 2, GBIT, 10 * GBIT, inter_latency_s=20e-6, intra_latency_s=5e-6)
    work = Workload(
        param_bytes=S, compute_s=0.01, intra_node="all_reduce", hierarchical=True, update_values=S / 4
    )
    updates = predict("complete", cluster, work)
    shared = predict("complete", cluster, replace(work, moment_values=S / 4, share_every=every))
    assert shared.inter_bytes_per_rank == pytest.approx(updates.inter_bytes_per_rank * (1 + 1 / every))
    assert shared.node_sum_bytes_per_rank == pytest.approx(updates.node_sum_bytes_per_rank)
    assert shared.iteration_s > updates.iteration_s  # communication-bound here
    assert replace(work, moment_values=S / 4, share_every=every).rounds(build("complete", 4, 2)) == every
    with pytest.raises(ValueError, match="moment_values=1: the nodes' second moment is shared only with"):
        Workload(param_bytes=S, compute_s=0.1, moment_values=1.0)
    with pytest.raises(ValueError, match="share_every must be >= 1"):
        Workload(param_bytes=S, compute_s=0.1, intra_node="all_reduce", moment_values=1.0, share_every=0)


def _node_sum_seconds(cluster: Cluster) -> float:
    """The node's gradient all-reduce by hand: a ring of L ranks over 2 S bytes (g and g**2)."""
    local = cluster.ranks_per_node
    return (
        2 * (local - 1) / local * 2 * S / cluster.intra_bytes_per_s
        + 2 * (local - 1) * cluster.intra_latency_s
    )


def test_intra_node_all_reduce_on_2_nodes_x_2_with_aer() -> None:
    """The same bytes across nodes as aer on the ranks; inside nodes the gradient all-reduce instead
    of aer's intra-node pairs; the step waits for the all-reduce (compute-bound here: C + T_node)."""
    cluster = Cluster(2, 2, GBIT, 10 * GBIT, inter_latency_s=20e-6, intra_latency_s=5e-6)
    work = Workload(param_bytes=S, compute_s=2.0)  # aer's group of 4 (1.2 s on the link) is hidden
    plain = predict("aer", cluster, work)
    ours = predict("aer", cluster, replace(work, intra_node="all_reduce"))
    node_s = _node_sum_seconds(cluster)
    assert node_s == pytest.approx(2 * S / (10 * GBIT) + 10e-6)  # 0.16 s
    # every other step the ring of ranks 0-3 crosses the node link twice, 1.5 S per edge
    assert ours.inter_bytes_per_rank == pytest.approx(plain.inter_bytes_per_rank)
    assert ours.inter_bytes_per_rank == pytest.approx(2 * 1.5 * S / 4 / 2)
    assert plain.node_sum_bytes_per_rank == 0 and plain.node_sum_s == 0
    assert ours.node_sum_bytes_per_rank == pytest.approx(2 * S)  # 2 (L-1)/L * 2 S, all inside the node
    assert ours.node_sum_s == pytest.approx(node_s)
    # aer's even steps: intra-node pairs (S each) on the ranks, nothing over nodes (ranks 0, 1 are
    # replicas); odd steps: the same ring of 4 (1.5 S); and the gradient all-reduce every step
    assert plain.sent_bytes_per_rank == pytest.approx((S + 1.5 * S) / 2)
    assert ours.sent_bytes_per_rank == pytest.approx(1.5 * S / 2 + 2 * S)
    assert ours.comm_s == pytest.approx(plain.comm_s - (S / (10 * GBIT) + 10e-6) / 2 + node_s)
    assert plain.iteration_s == pytest.approx(2.0)
    assert ours.iteration_s == pytest.approx(plain.iteration_s + node_s)
    assert ours.lower_bound_s == pytest.approx(plain.lower_bound_s + node_s)


def test_intra_node_all_reduce_without_squares_sums_the_gradient_bytes_only() -> None:
    """second_moment other than group_gradient: the node's all-reduce carries g alone, S bytes."""
    cluster = Cluster(2, 2, GBIT, 10 * GBIT, inter_latency_s=20e-6, intra_latency_s=5e-6)
    work = Workload(param_bytes=S, compute_s=2.0, intra_node="all_reduce")
    squares = predict("aer", cluster, work)
    alone = predict("aer", cluster, replace(work, node_squares=False))
    assert replace(work, node_squares=False).node_sum_bytes() == S
    assert alone.node_sum_bytes_per_rank == pytest.approx(S)  # 2 (L-1)/L * S
    assert alone.node_sum_s == pytest.approx(S / (10 * GBIT) + 10e-6)
    assert alone.inter_bytes_per_rank == pytest.approx(squares.inter_bytes_per_rank)
    assert alone.iteration_s == pytest.approx(squares.iteration_s - S / (10 * GBIT))
    assert replace(work, intra_node="gossip", node_squares=False).node_sum_bytes() == 0


def test_intra_node_all_reduce_overlaps_only_the_update_of_earlier_buckets() -> None:
    cluster = Cluster(2, 2, GBIT, 10 * GBIT, inter_latency_s=20e-6, intra_latency_s=5e-6)
    node_s = _node_sum_seconds(cluster)  # 0.16 s: 0.04 s per bucket, longer than a bucket's update
    work = Workload(param_bytes=S, compute_s=2.0, update_s=0.04, bucket_bytes=S / 4, intra_node="all_reduce")
    assert predict("aer", cluster, replace(work, intra_node="gossip")).iteration_s == pytest.approx(2.04)
    # step: bucket k's sum arrives at C + (k+1) T/4 and its update follows; the last one ends the step
    assert predict("aer", cluster, work).iteration_s == pytest.approx(2.0 + node_s + 0.01)
    # backward: each bucket's hook sums and waits; no update while on the wire: all sums first
    for other in (replace(work, overlap="backward"), replace(work, update_overlaps_comm=False)):
        assert predict("aer", cluster, other).iteration_s == pytest.approx(2.0 + node_s + 0.04)


def test_intra_node_all_reduce_on_one_node_is_the_all_reduce_alone() -> None:
    cluster = _cluster(nodes=1, local=4, intra=10 * GBIT)
    work = Workload(param_bytes=S, compute_s=0.5, intra_node="all_reduce")
    for method in METHODS[1:]:  # a node alone does not gossip
        prediction = predict(method, cluster, work)
        assert prediction.inter_bytes_per_rank == 0
        assert prediction.sent_bytes_per_rank == pytest.approx(2 * 3 / 4 * 2 * S)
        assert prediction.iteration_s == pytest.approx(0.5 + _node_sum_seconds(cluster)), method
    # All-Reduce is DDP's: intra_node is not its
    assert predict(ALLREDUCE, cluster, work) == predict(
        ALLREDUCE, cluster, replace(work, intra_node="gossip")
    )


def test_intra_node_all_reduce_builds_the_topology_over_nodes() -> None:
    cluster = _cluster(nodes=3, local=2)  # 6 ranks pair up on a ring, 3 nodes do not
    work = Workload(param_bytes=S, compute_s=0.1)
    assert {p.method for p in predict_all(cluster, work)} == {ALLREDUCE, "complete", "ring"}
    over_nodes = predict_all(cluster, replace(work, intra_node="all_reduce"))
    assert {p.method for p in over_nodes} == {ALLREDUCE, "complete"}


def test_intra_node_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="intra_node must be 'gossip' or 'all_reduce', got 'node'"):
        Workload(param_bytes=S, compute_s=0.1, intra_node="node")
    with pytest.raises(ValueError, match=r"with intra_node='all_reduce' .* leave gradient_values 0"):
        Workload(param_bytes=S, compute_s=0.1, gradient_values=S / 4, intra_node="all_reduce")


@pytest.mark.parametrize(("text", "value"), [("350M", 3.5e8), ("1.5g", 1.5e9), ("12k", 12e3), ("42", 42.0)])
def test_parse_size(text: str, value: float) -> None:
    assert parse_size(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["35OM", "", "M", "1.2.3", "-5M", "10X"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="expected a number with optional K/M/G suffix"):
        parse_size(text, "--params")


def _argv(params: str, compute_ms: int, nodes: int, gpus_per_node: int, inter_gbps: int) -> list[str]:
    return [
        *("--params", params, "--compute-ms", str(compute_ms), "--nodes", str(nodes)),
        *("--gpus-per-node", str(gpus_per_node), "--inter-gbps", str(inter_gbps)),
    ]


PREVIOUS_DEFAULT = ["--exchange", "parameters", "--average-every", "0", "--intra-node", "gossip"]
PREVIOUS_DEFAULT += ["--second-moment", "all_ranks"]  # Setting()'s fields until 2026-11-29


def test_cli_prints_table_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv("350M", 180, nodes=8, gpus_per_node=4, inter_gbps=25)) == 0
    out = capsys.readouterr().out
    for method in METHODS:
        assert f"| {method} |" in out
    assert "speed-up vs all-reduce" in out
    # without options the rows are the default setting with each topology; the default's own graph
    # is named where another is faster per iteration
    assert "each topology with exchange='bf16_updates', average_every=32, intra_node='all_reduce', " in out
    assert "Use DecentralizedAdam(params, setting=make_setting(topology='aer')): predicted" in out
    assert "(one-peer-exp, the default setting's graph, " in out
    # options that differ from the default are written out in the advice
    assert main([*_argv("350M", 180, nodes=8, gpus_per_node=4, inter_gbps=25), *PREVIOUS_DEFAULT]) == 0
    advice = capsys.readouterr().out.splitlines()[-1]
    assert advice.startswith(
        "Use DecentralizedAdam(params, setting=make_setting(topology='aer', exchange='parameters', "
        "average_every=0, intra_node='gossip', second_moment='all_ranks')): predicted 1.93x"
    )


def test_cli_names_the_default_where_its_graph_is_the_fastest(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 single-rank nodes, 1 s of compute: every graph's bfloat16 updates hide behind it (0.4-0.6 s on
    # 1 Gbit/s), All-Reduce's float32 gradients (1.2 s) do not; the default's graph wins the tie
    argv = _argv("25M", 1000, nodes=4, gpus_per_node=1, inter_gbps=1)
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    rows = {row[1].strip(): float(row[2]) for row in table}
    assert rows["one-peer-exp"] <= rows["aer"], out
    assert out.splitlines()[-1].startswith("Use DecentralizedAdam(params) (the default setting): predicted")


def test_cli_exchange_names_the_option_and_drops_changing_groups(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*_argv("25M", 10, nodes=4, gpus_per_node=2, inter_gbps=1), "--intra-node", "all_reduce"]
    assert (
        main([*argv, "--exchange", "bf16_updates", "--average-every", "0", "--second-moment", "all_ranks"])
        == 0
    )
    out = capsys.readouterr().out
    assert "| complete |" in out and "| aer |" not in out
    for name in (
        "ring",
        "one-peer-exp",
        "aer",
    ):  # changing groups and no exact average: refused, as the optimizer does
        assert f"not buildable: {name} (exchange='bf16_updates' sends updates from a reference point" in out
    assert (
        "average_every=0" in out.splitlines()[-1]
    )  # complete, with the options that differ from the default
    assert main([*argv, "--exchange", "bf16_updates"]) == 0  # with the default's exact averages: every graph
    out = capsys.readouterr().out
    assert "| aer |" in out and "not buildable" not in out


def test_cli_shared_second_moment_adds_its_bytes_when_given(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        *_argv("25M", 10, nodes=2, gpus_per_node=2, inter_gbps=1), "--intra-node", "all_reduce",
        "--second-moment", "group_gradient", "--exchange", "bf16_updates",
    ]  # fmt: skip
    rows = {}
    for share in ([], ["--share-second-moment-every", "2"], ["--share-second-moment-every", "0"]):
        assert main([*argv, *share]) == 0
        out = capsys.readouterr().out
        rows[" ".join(share)] = next(line for line in out.splitlines() if line.startswith("| complete |"))
    assert rows[""] == rows["--share-second-moment-every 0"]  # the default: not shared
    assert rows[""] != rows["--share-second-moment-every 2"]


def test_cli_hierarchical_flag_speeds_up_multi_node_groups(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*_argv("25M", 10, nodes=4, gpus_per_node=2, inter_gbps=1), *PREVIOUS_DEFAULT[:-2]]  # gossip

    def aer_ms(extra: list[str]) -> float:
        assert main(argv + extra) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| aer |"))
        return float(row.split("|")[2])

    plain = ["--second-moment", "all_ranks"]
    assert aer_ms(["--hierarchical", *plain]) < aer_ms(plain)
    assert aer_ms(["--v-every", "2"]) > aer_ms(plain)  # the gradient sums ride on the slow link too


def test_cli_intra_node_all_reduce_adds_the_node_sum_to_the_gossip_rows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 1e8 parameter bytes, 2 x 2 ranks, 8 Gbit/s inside nodes: the node sum takes 2e8 / 1e9 s + 2 x 5 us
    argv = [
        *_argv("25M", 400, nodes=2, gpus_per_node=2, inter_gbps=100),
        "--intra-gbps",
        "8",
        *PREVIOUS_DEFAULT,
    ]

    def rows(extra: list[str]) -> tuple[dict[str, float], str]:
        assert main(argv + extra) == 0
        out = capsys.readouterr().out
        table = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
        return {row[1].strip(): float(row[2]) for row in table}, out

    plain, _ = rows([])
    ours, out = rows(["--intra-node", "all_reduce", "--second-moment", "group_gradient"])
    assert plain["aer"] == pytest.approx(400.0, abs=0.05)  # compute-bound
    assert ours["aer"] == pytest.approx(400.0 + 200.01, abs=0.05)
    assert ours[ALLREDUCE] == plain[ALLREDUCE]
    assert "every step each node all-reduces 200 MB (gradients and their squares) in 200.0 ms" in out
    # the default all_ranks needs no squares: half the bytes (1e8 / 1e9 s + 2 x 5 us)
    gradients_only, out = rows(["--intra-node", "all_reduce"])
    assert gradients_only["aer"] == pytest.approx(400.0 + 100.01, abs=0.05)
    assert "every step each node all-reduces 100 MB (gradients) in 100.0 ms" in out


def test_cli_says_all_reduce_when_compute_dominates(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--params", "10M", "--compute-ms", "1000", "--nodes", "2", "--inter-gbps", "100"]
    assert main(argv) == 0
    assert "Use All-Reduce" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            "--params 35OM --compute-ms 1 --nodes 2 --inter-gbps 1",
            "--params 35OM: expected a number with optional K/M/G",
        ),
        ("--params 1M --compute-ms 1 --nodes 0 --inter-gbps 1", "expected a whole number >= 1"),
        ("--params 1M --compute-ms 1 --nodes 2 --inter-gbps -3", "expected a number > 0"),
        ("--params 1M --compute-ms x --nodes 2 --inter-gbps 1", "expected a number, got 'x'"),
        ("--params 1M --compute-ms 1 --nodes 2 --inter-gbps 1 --forward-fraction 2", "forward_fraction"),
        ("--params 1M --compute-ms 1 --nodes 2 --inter-gbps 1 --intra-node node", "invalid choice: 'node'"),
        (
            "--params 1M --compute-ms 1 --nodes 2 --inter-gbps 1 --intra-node all_reduce --v-every 2",
            "v_every=2: with intra_node='all_reduce' the node's gradients give",
        ),
        (
            "--params 1M --compute-ms 1 --nodes 2 --inter-gbps 1 --second-moment local --v-every 2",
            "v_every=2 says how often second_moment='group_gradient' sends the gradient, but "
            "second_moment='local'",
        ),
        (
            "--params 1M --compute-ms 1 --nodes 2 --inter-gbps 1 --intra-node all_reduce "
            "--share-second-moment-every 2",
            "share_second_moment_every=2 shares the nodes' second_moment='group_gradient' estimate, but "
            "second_moment='global'",
        ),
    ],
)
def test_cli_bad_input(argv: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv.split())
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_prediction_is_finite_for_large_clusters() -> None:
    cluster = Cluster(nodes=8, ranks_per_node=4, inter_bytes_per_s=25 * GBIT, intra_bytes_per_s=800 * GBIT)
    for p in predict_all(cluster, Workload(param_bytes=1.4e9, compute_s=0.18, update_s=0.01)):
        assert math.isfinite(p.iteration_s) and p.iteration_s >= 0.18


def test_a_built_topology_is_predicted_as_its_name_is_and_must_fit_the_cluster() -> None:
    from decentadam.options import Setting

    cluster = Cluster(nodes=4, ranks_per_node=2, inter_bytes_per_s=125e6, intra_bytes_per_s=1e9)
    work = Workload(param_bytes=100e6, compute_s=0.1)
    assert predict(build("aer", 8, 2), cluster, work) == predict("aer", cluster, work)
    averaged = Setting(topology="ring", average_every=4).schedule(8, 2)  # every 4th step all ranks
    plain, every4 = predict("ring", cluster, work), predict(averaged, cluster, work)
    assert every4.method == averaged.name and every4.inter_bytes_per_rank > plain.inter_bytes_per_rank
    with pytest.raises(ValueError, match="of 4 ranks, the cluster of 8"):
        predict(build("ring", 4, 2), cluster, work)


def test_a_setting_is_priced_with_its_exact_averages_and_its_global_estimates() -> None:
    """The default on 4 single-rank nodes: one partner per step (bfloat16 updates, 2P bytes), every
    32nd step an all-reduce over the 4 nodes of the updates and, with Global(), of each rank's
    estimate (2P more): 2 (3/4) 4P = 6P. Per rank and step (31 x 2P + 6P) / 32 across node links."""
    from decentadam.options import AllRanks, Setting
    from decentadam.runtime_model import predict_setting, workload_of

    values = 25e6
    cluster = Cluster(nodes=4, ranks_per_node=1, inter_bytes_per_s=GBIT, intra_bytes_per_s=100 * GBIT)
    work = Workload(param_bytes=4 * values, compute_s=0.1)
    default = predict_setting(Setting(), cluster, work)
    assert default.method == "one-peer-exp+avg32"
    assert default.inter_bytes_per_rank == pytest.approx((31 * 2 * values + 6 * values) / 32)
    plain = predict_setting(Setting(second_moment=AllRanks()), cluster, work)  # the estimates not sent
    assert plain.inter_bytes_per_rank == pytest.approx((31 * 2 * values + 3 * values) / 32)
    assert workload_of(Setting(), work).global_moment_values == values
    with pytest.raises(ValueError, match="one-peer-exp needs world_size to be a power of two"):
        predict_setting(Setting(), replace(cluster, nodes=3), work)
