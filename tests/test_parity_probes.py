"""The parity probes of benchmarks.parity (mean_weights, shared_v, predicted_point, gossip_v,
v_oracle, lazy_mixing, point_shift), and the group-gradient second moment that began as one
(group_gradient_v).

Each probe changes one thing about ``DecentralizedAdam(second_moment="all_ranks")``; these tests
pin what the measurements in docs/parity.md rely on: on one rank every probe's update is AdamW's,
what a probe sends is the library's step, and the mean-weights hook makes the ranks take their
gradients at one point.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.parity.gossip_v import gossip_v_update
from benchmarks.parity.mean_weights import install
from benchmarks.parity.predicted_point import predicted_update
from benchmarks.parity.shared_v import shared_v_update
from benchmarks.parity.v_oracle import v_oracle_update
from decentadam import AccumAdamW, DecentralizedAdam
from tests.distributed_harness import run_distributed

BETAS, EPS, LR, WD = (0.9, 0.98), 1e-9, 1e-2, 0.01
UPDATES = {
    "shared_v": shared_v_update,
    "predicted_point": predicted_update,
    "gossip_v": gossip_v_update,
    "v_oracle": v_oracle_update,
}


def run(update: Any, noise_ranks: int, steps: int = 15) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Parameters after each step from these gradients: (the probe's, AccumAdamW's), and the probe's state."""
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(40, generator=generator, dtype=torch.float64) + 0.2 for _ in range(steps)]
    probe = torch.zeros(40, dtype=torch.float64)
    reference = torch.zeros(40, dtype=torch.float64)
    optimizer = AccumAdamW([reference], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, noise_ranks=noise_ranks)
    group = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD, "noise_ranks": noise_ranks}
    state: dict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    differences = []
    for g in gradients:
        probe.grad, reference.grad = g.clone(), g.clone()
        update(state, group, [probe])
        optimizer.step()
        differences.append(probe - reference)
        if "pull" in state[probe]:
            assert torch.all(state[probe]["pull"].abs() <= (1 - 1 / noise_ranks) * LR * 1e3)
    return differences, state[probe]


@pytest.mark.parametrize("name", sorted(UPDATES))
def test_on_one_rank_every_probe_is_adamw(name: str) -> None:
    differences, state = run(UPDATES[name], noise_ranks=1)
    assert max(float(d.abs().max()) for d in differences) < 1e-14
    if "pull" in state:
        assert torch.count_nonzero(state["pull"]) == 0  # n = 1: the point is the sent weights


@pytest.mark.parametrize("name", ["shared_v", "predicted_point"])
def test_what_a_probe_sends_is_the_all_ranks_step(name: str) -> None:
    """Alone (no process group) the shared second moment is the rank's own corrected one, and the
    predicted point moves only the weights computed with, not the step sent."""
    differences, state = run(UPDATES[name], noise_ranks=4)
    assert max(float(d.abs().max()) for d in differences) < 1e-14
    if name == "predicted_point":
        assert float(state["pull"].abs().max()) > 0  # the point does move


def test_the_gossiped_second_moment_differs_from_all_ranks_only_by_its_bias_correction() -> None:
    differences, _ = run(gossip_v_update, noise_ranks=4, steps=40)
    assert 0 < float(differences[-1].abs().max()) < 0.05 * LR * 40


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), x[:, :2].sin())


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    steps: int,
    gradients: list[torch.Tensor] | None = None,
    seed_offset: int = 0,
) -> list[torch.Tensor]:
    """The weights after each of ``steps`` steps on this rank's batches (and, if asked, each step's
    gradient in the optimizer's bucket order); ``seed_offset`` continues a run step by step."""
    weights = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * rank + seed_offset + step)
        x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        loss_of(model, x).backward()
        if gradients is not None:
            gradients.append(torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))]))
        optimizer.step()
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return weights


def mean_weights_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hooked in (False, True):
        model = make_model()
        optimizer = DecentralizedAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, topology="complete")
        handle = install() if hooked else None
        weights = train(model, optimizer, rank, 6)
        if handle is not None:
            handle.remove()
        optimizer.close()
        out["hooked" if hooked else "plain"] = weights
    return out


def test_mean_weights_puts_every_rank_at_the_mean_of_what_was_sent() -> None:
    results = run_distributed(mean_weights_worker, 2)
    for step in range(6):
        hooked = [r["hooked"][step] for r in results]
        torch.testing.assert_close(hooked[0], hooked[1], rtol=0, atol=0)  # one point for every rank
        plain = [r["plain"][step] for r in results]
        assert not torch.equal(plain[0], plain[1])  # without the hook each rank holds its own step
    # step 0 starts from one point either way: the hooked weights are the mean of the plain ones
    torch.testing.assert_close(results[0]["hooked"][0], (results[0]["plain"][0] + results[1]["plain"][0]) / 2)


def group_gradient_worker(rank: int, world_size: int) -> dict[str, Any]:
    model = make_model()
    optimizer = DecentralizedAdam(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        topology="complete",
        second_moment="group_gradient",  # the group_gradient_v probe, now the library's option
        v_every=1,
    )
    gradients: list[torch.Tensor] = []
    train(model, optimizer, rank, 5, gradients)
    first = next(iter(reversed(list(model.parameters()))))  # the first parameter of the one bucket
    state = optimizer.state[first]
    optimizer.close()
    return {
        "gradients": gradients,
        "group_sq": state["group_sq"].reshape(-1),
        "updates": state["group_updates"],
    }


def test_group_gradient_v_on_all_ranks_is_allreduces_second_moment() -> None:
    """On a group of all n ranks the estimate is the EMA of the mean gradient's square: All-Reduce's
    V (each step's mean arriving one step later: a pair's sum of the bfloat16-rounded gradients,
    rounded to bfloat16)."""
    results = run_distributed(group_gradient_worker, 2)
    beta2 = BETAS[1]
    expected = torch.zeros_like(results[0]["group_sq"])
    for step in range(5):  # close() folds in the fifth step's gradients, which were in flight
        a, b = (r["gradients"][step].to(torch.bfloat16) for r in results)
        mean = (a + b).double() / 2
        expected = beta2 * expected + (1 - beta2) * mean[: expected.numel()].square()
    for result in results:
        assert result["updates"] == 5
        torch.testing.assert_close(result["group_sq"].double(), expected, rtol=1e-5, atol=1e-12)


def lazy_worker(rank: int, world_size: int) -> dict[str, Any]:
    import os

    from benchmarks.parity.lazy_mixing import LazyMixingAdam

    out = {}
    for alpha in ("1.0", "0.5"):
        os.environ["DECENTADAM_MIX_WEIGHT"] = alpha
        model = make_model()
        optimizer = LazyMixingAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, topology="complete")
        sent = train(model, optimizer, rank, 3)
        optimizer.wait_for_exchanges()
        out[alpha] = sent
        optimizer.close()
    return out


def test_lazy_mixing_moves_half_way_to_the_mean() -> None:
    """alpha = 1 is DecentralizedAdam's full mixing; with alpha = 0.5 the second step starts half way
    between the rank's weights and the mean, so the ranks end up further apart."""
    results = run_distributed(lazy_worker, 2)
    full, lazy = [r["1.0"] for r in results], [r["0.5"] for r in results]
    torch.testing.assert_close(full[0][0], lazy[0][0], rtol=0, atol=0)  # the first step does not mix
    spread_full = float((full[0][2] - full[1][2]).norm())
    spread_lazy = float((lazy[0][2] - lazy[1][2]).norm())
    assert spread_lazy > 1.2 * spread_full > 0


def v_oracle_worker(rank: int, world_size: int) -> dict[str, Any]:
    from benchmarks.parity.v_oracle import VOracleAdam

    model = make_model()
    optimizer = VOracleAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, topology="ring")
    gradients: list[torch.Tensor] = []
    train(model, optimizer, rank, 4, gradients)
    first = next(iter(reversed(list(model.parameters()))))  # the first parameter of the one bucket
    state = optimizer.state[first]
    optimizer.close()
    return {"gradients": gradients, "oracle_sq": state["oracle_sq"].reshape(-1)}


def test_v_oracle_divides_by_the_second_moment_of_the_all_reduced_gradient() -> None:
    """Every rank holds All-Reduce's V of this step's mean gradient, on any graph."""
    results = run_distributed(v_oracle_worker, 2)
    beta2 = BETAS[1]
    expected = torch.zeros_like(results[0]["oracle_sq"])
    for step in range(4):
        mean = sum(r["gradients"][step] for r in results) / 2
        expected = beta2 * expected + (1 - beta2) * mean[: expected.numel()].square()
    for result in results:
        torch.testing.assert_close(result["oracle_sq"], expected, rtol=1e-12, atol=1e-15)


def point_shift_worker(rank: int, world_size: int) -> dict[str, Any]:
    import os

    from benchmarks.parity.point_shift import PointShiftAdam

    def shift_of(optimizer: PointShiftAdam, model: nn.Module) -> torch.Tensor:
        shift = {}
        for bucket in optimizer.buckets:
            if id(bucket) in optimizer._shifts:
                shift.update(zip(map(id, bucket.params), optimizer._shifts[id(bucket)], strict=True))
        return torch.cat([shift.get(id(p), torch.zeros_like(p)).reshape(-1) for p in model.parameters()])

    out: dict[str, Any] = {}
    for scale in ("1.0", "0.0"):
        os.environ["DECENTADAM_POINT_SHIFT"] = scale
        model = make_model()
        optimizer = PointShiftAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, topology="complete")
        points, sent = [], []
        for step in range(4):
            (point,) = train(model, optimizer, rank, 1, seed_offset=step)
            points.append(point)
            sent.append(point - shift_of(optimizer, model))
        optimizer.close()
        out[scale] = {"points": points, "sent": sent}
    model = make_model()
    plain = DecentralizedAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, topology="complete")
    out["plain"] = train(model, plain, rank, 4)
    plain.close()
    return out


def test_point_shift_moves_the_gradient_point_by_beta1_times_the_last_deviation() -> None:
    """What a rank sends is DecentralizedAdam's step from the gradient it took; the point it takes
    the next gradient at is shifted by b1 (mix_i(t) - x_i(t)), and the shifts of a group sum to zero.
    With c = 0 it is DecentralizedAdam."""
    results = run_distributed(point_shift_worker, 2)
    for result in results:
        for a, b in zip(result["0.0"]["points"], result["plain"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    shifted = [r["1.0"] for r in results]
    assert not torch.equal(shifted[0]["points"][3], results[0]["plain"][3])  # the points differ
    for step in range(1, 4):
        mean_sent = (shifted[0]["sent"][step - 1] + shifted[1]["sent"][step - 1]) / 2
        for rank in range(2):
            shift = shifted[rank]["points"][step] - shifted[rank]["sent"][step]
            expected = BETAS[0] * (mean_sent - shifted[rank]["sent"][step - 1])
            torch.testing.assert_close(shift, expected, rtol=1e-12, atol=1e-15)
        total = (shifted[0]["points"][step] + shifted[1]["points"][step]) / 2
        torch.testing.assert_close(total, (shifted[0]["sent"][step] + shifted[1]["sent"][step]) / 2)


def node_probe_worker(rank: int, world_size: int, probe: str, every: int) -> dict[str, Any]:
    """Three or four steps of a node probe on 2 nodes x 2: each rank's own gradient, the node's mean
    gradient the step leaves in ``.grad``, and ``A`` after each step."""
    import os

    from benchmarks.parity.node_exact_v import NodeExactVAdam
    from benchmarks.parity.node_shared_a import NodeSharedAAdam

    variable, optimizer_class = {
        "exact_v": ("DECENTADAM_EXACT_V_EVERY", NodeExactVAdam),
        "shared_a": ("DECENTADAM_SHARED_A_EVERY", NodeSharedAAdam),
    }[probe]
    os.environ[variable] = str(every)
    model = make_model()
    optimizer = optimizer_class(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        topology="complete",
        intra_node="all_reduce",
        second_moment="group_gradient",
        local_world_size=2,
    )
    own_grads, node_means, group_sqs = [], [], []
    for step in range(4):
        generator = torch.Generator().manual_seed(100 * rank + step)
        optimizer.zero_grad()
        loss_of(model, torch.randn(8, 4, generator=generator, dtype=torch.float64)).backward()
        own_grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()  # leaves the node's mean gradient in .grad
        node_means.append([p.grad.clone() for p in model.parameters()])
        group_sqs.append([optimizer.state[p]["group_sq"].clone() for p in model.parameters()])
    optimizer.close()
    return {"own_grads": own_grads, "node_means": node_means, "group_sqs": group_sqs}


def node_z(results: list[dict[str, Any]], node: int, step: int, index: int) -> torch.Tensor:
    """The group-gradient sample of a node of 2 ranks out of 4: gbar^2 - (mean g^2 - gbar^2) / 2."""
    g = [results[2 * node + i]["own_grads"][step][index] for i in range(2)]
    mean = (g[0] + g[1]) / 2
    spread = (g[0].square() + g[1].square()) / 2 - mean.square()
    return mean.square() - spread * (0.5 - 0.25) / 0.5


@pytest.mark.parametrize("every", [1, 2])
def test_node_shared_a_averages_the_nodes_second_moment_every_k_steps(every: int) -> None:
    """Each node folds its own z into A; after every k-th step A is the nodes' mean (bf16-rounded),
    the same on all ranks; between averages the two nodes' A differ."""
    results = run_distributed(node_probe_worker, 4, "shared_a", every)
    beta2 = BETAS[1]
    for index in range(len(results[0]["own_grads"][0])):
        held = [torch.zeros_like(results[0]["group_sqs"][0][index]) for _ in range(2)]  # per node
        for step in range(4):
            own = [beta2 * held[node] + (1 - beta2) * node_z(results, node, step, index) for node in range(2)]
            for rank, result in enumerate(results):
                assert torch.equal(
                    result["group_sqs"][step][index], results[rank - rank % 2]["group_sqs"][step][index]
                )
            if (step + 1) % every:
                for node in range(2):
                    torch.testing.assert_close(results[2 * node]["group_sqs"][step][index], own[node])
                assert not torch.allclose(
                    results[0]["group_sqs"][step][index], results[2]["group_sqs"][step][index]
                )
                held = own
                continue
            mean = (own[0].to(torch.bfloat16).double() + own[1].to(torch.bfloat16).double()) / 2
            for result in results:
                torch.testing.assert_close(result["group_sqs"][step][index], mean, rtol=2**-7, atol=1e-30)
                assert torch.equal(result["group_sqs"][step][index], results[0]["group_sqs"][step][index])
            held = [results[0]["group_sqs"][step][index]] * 2


def exact_sample(results: list[dict[str, Any]], step: int, index: int) -> torch.Tensor:
    """The all-rank mean of the nodes' bfloat16-rounded mean gradients, squared."""
    rounded = [r["node_means"][step][index].to(torch.bfloat16).float() for r in results]
    return (sum(rounded) / len(rounded)).double().square()


@pytest.mark.parametrize("every", [1, 2])
def test_node_exact_v_folds_in_the_all_rank_mean_gradient_every_k_steps(every: int) -> None:
    """k = 1: the nodes' A is All-Reduce's V of the bf16-rounded mean gradient; k = 2: the first
    step keeps the node's own estimate z, the second replaces its z by the exact sample."""
    results = run_distributed(node_probe_worker, 4, "exact_v", every)
    beta2 = BETAS[1]
    for index in range(len(results[0]["node_means"][0])):
        torch.testing.assert_close(  # the nodes are replicas: ranks 0, 1 and ranks 2, 3
            results[0]["node_means"][0][index], results[1]["node_means"][0][index], rtol=0, atol=0
        )
        for rank, result in enumerate(results):
            expected = torch.zeros_like(results[0]["group_sqs"][0][index])
            for step in range(3):
                if (step + 1) % every:  # not an exact step: the library's fold of the node's own z
                    expected = result["group_sqs"][step][index]
                    other_node = results[2 if rank < 2 else 0]["group_sqs"][step][index]
                    assert not torch.allclose(expected, other_node)  # each node its own estimate
                    continue
                expected = beta2 * expected + (1 - beta2) * exact_sample(results, step, index)
                torch.testing.assert_close(result["group_sqs"][step][index], expected, rtol=1e-6, atol=1e-14)


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5"])
def test_a_probe_period_that_is_not_a_positive_integer_is_an_error_naming_its_variable(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.parity.node_shared_a import shared_every

    monkeypatch.setenv("DECENTADAM_SHARED_A_EVERY", text)
    with pytest.raises(ValueError, match=f"DECENTADAM_SHARED_A_EVERY must be an integer >= 1, got '{text}'"):
        shared_every()
    monkeypatch.delenv("DECENTADAM_SHARED_A_EVERY")
    assert shared_every() == 2


def test_a_one_point_switch_that_is_not_0_or_1_is_an_error_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks.parity.recipe import run_recipe

    monkeypatch.setenv("DECENTADAM_MEAN_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="DECENTADAM_MEAN_WEIGHTS must be 0 or 1, got 'yes'"):
        run_recipe()
