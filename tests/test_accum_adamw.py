"""AccumAdamW: == torch AdamW for accum_steps=1, foreach == for-loop, the formulas for s > 1 and for the
second moment of a mean of n gradients, state."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

from decentadam import AccumAdamW, DecentralizedAdam
from decentadam.optim.accum_adamw import accum_adamw


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 11), nn.GELU(), nn.LayerNorm(11), nn.Linear(11, 2)).double()


def groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, offset: int = 0) -> None:
    for step in range(offset, offset + steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(32, 7, generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        (model(x) - x[:, :2].sin()).square().mean().backward()
        optimizer.step()


def params_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("foreach", [False, True])
def test_accum_steps_1_equals_torch_adamw(foreach: bool) -> None:
    ours, theirs = make_model(), make_model()
    train(ours, AccumAdamW(groups(ours, 0.1), lr=1e-2, betas=(0.9, 0.98), foreach=foreach), 100)
    train(theirs, torch.optim.AdamW(groups(theirs, 0.1), lr=1e-2, betas=(0.9, 0.98), foreach=foreach), 100)
    torch.testing.assert_close(params_of(ours), params_of(theirs), rtol=0, atol=1e-13)


@pytest.mark.parametrize(("accum_steps", "noise_ranks"), [(1, 1), (3, 1), (4, 1), (1, 4), (1, 16)])
def test_foreach_equals_for_loop(accum_steps: int, noise_ranks: int) -> None:
    a, b = make_model(), make_model()
    kwargs = {"lr": 1e-2, "accum_steps": accum_steps, "noise_ranks": noise_ranks}
    train(a, AccumAdamW(groups(a, 0.05), **kwargs, foreach=False), 37)
    train(b, AccumAdamW(groups(b, 0.05), **kwargs, foreach=True), 37)
    torch.testing.assert_close(params_of(a), params_of(b), rtol=0, atol=1e-13)


@pytest.mark.parametrize("foreach", [False, True])
def test_noise_ranks_matches_the_formula(foreach: bool) -> None:
    """A separate, plain implementation of the corrected second moment on one flat vector."""
    lr, beta1, beta2, eps, wd, n = 1e-2, 0.9, 0.98, 1e-8, 0.1, 4
    x0 = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    trend = torch.linspace(-1.0, 1.0, 50, dtype=torch.float64)
    gradients = [
        trend + torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(30)
    ]
    param = nn.Parameter(x0.clone())
    optimizer = AccumAdamW([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, noise_ranks=n)
    for g in gradients:
        param.grad = g.clone()
        optimizer.step()

    x, m, v, noise = (
        x0.clone(),
        torch.zeros(50, dtype=torch.float64),
        torch.zeros(50, dtype=torch.float64),
        0.0,
    )
    floored = 0
    for t, g in enumerate(gradients, start=1):
        if t > 1:
            deviation = g - m / (1 - beta1 ** (t - 1))
            noise = beta2 * noise + (1 - beta2) * (1 + beta1) / 2 * deviation**2
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        v_hat = v / (1 - beta2**t)
        if t > 1:
            corrected = v_hat - (1 - 1 / n) * noise / (1 - beta2 ** (t - 1))
            floored += int((corrected < v_hat / n).sum())
            v_hat = torch.maximum(corrected, v_hat / n)
        x = x * (1 - lr * wd) - lr * (m / (1 - beta1**t)) / (v_hat.sqrt() + eps)
    torch.testing.assert_close(param.detach(), x, rtol=0, atol=1e-13)
    assert 0 < floored < 29 * 50, "the test should exercise both sides of the floor"


@pytest.mark.parametrize("floor_ranks", [None, 16])
def test_group_sqs_replace_the_noise_correction_on_both_paths(floor_ranks: int | None) -> None:
    """``accum_adamw(group_sqs=...)``, DecentralizedAdam's group-gradient second moment: where a
    parameter has ``A`` (``u > 0``), ``v = max(A / (1 - beta2**(k u)), V_hat / F)``; elsewhere the
    noise correction with the same floor; foreach == for-loop == the formula written out. ``F`` is
    ``floor_ranks`` (the shared A's ``N**2``), ``n`` by default."""
    lr, beta1, beta2, eps, n, k = 1e-2, 0.9, 0.98, 1e-8, 4, 2
    floor = n if floor_ranks is None else floor_ranks
    shapes = [(5,), (3, 4), (7,)]
    generator = torch.Generator().manual_seed(3)
    gradients = [
        [torch.randn(s, dtype=torch.float64, generator=generator) + 0.3 for s in shapes] for _ in range(8)
    ]

    def a_of(i: int, t: int) -> torch.Tensor | None:
        """A of parameter i before step t: the first two from t = 3 on (u = t - 2), the third never."""
        if i == 2 or t < 3:
            return None
        a = torch.zeros(shapes[i], dtype=torch.float64)
        for g in gradients[: t - 2]:
            a = beta2**k * a + (1 - beta2**k) * g[i].square()
        return a

    runs, noise_after = {}, {}
    for foreach, drop in itertools.product((False, True), (False, True)):
        params = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
        moments = [[torch.zeros(shape, dtype=torch.float64) for _ in range(3)] for shape in shapes]  # M V S
        steps = [torch.tensor(0.0, dtype=torch.float64) for _ in shapes]
        for t, grads in enumerate(gradients, start=1):
            group_sqs = [a_of(i, t) for i in range(3)]
            # where A replaces S, S may be left out (None), as DecentralizedAdam's step_group does
            noise_sqs = [
                None if drop and a is not None else m[2] for a, m in zip(group_sqs, moments, strict=True)
            ]
            accum_adamw(
                params, grads, [m[0] for m in moments], [m[1] for m in moments], [], steps,
                lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0, accum_steps=1,
                foreach=foreach, noise_ranks=n, noise_sqs=noise_sqs,
                group_sqs=group_sqs, group_updates=[max(t - 2, 0)] * 2 + [0], v_every=k,
                floor_ranks=floor_ranks,
            )  # fmt: skip
            if t == 2:
                noise_after[foreach, drop] = [m[2].clone() for m in moments]
        runs[foreach, drop] = params
        # S is neither read nor updated once A is there: the first two keep their S of step 2
        for i in (0, 1):
            torch.testing.assert_close(moments[i][2], noise_after[foreach, drop][i], rtol=0, atol=0)
        assert not torch.equal(moments[2][2], noise_after[foreach, drop][2])
    with pytest.raises(ValueError, match=r"needs its noise_sq or its group_sq \(with u > 0\)"):
        accum_adamw(
            params, gradients[0], [m[0] for m in moments], [m[1] for m in moments], [], steps,
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0, accum_steps=1,
            noise_ranks=n, noise_sqs=[None, moments[1][2], moments[2][2]],
            group_sqs=[None, None, None], group_updates=[0, 0, 0], v_every=k,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs its noise_sq or its group_sq"):  # an A not yet updated
        accum_adamw(
            params, gradients[0], [m[0] for m in moments], [m[1] for m in moments], [], steps,
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0, accum_steps=1,
            noise_ranks=n, noise_sqs=[None, moments[1][2], moments[2][2]],
            group_sqs=[moments[0][2], None, None], group_updates=[0, 0, 0], v_every=k,
        )  # fmt: skip
    floored = 0
    for i in range(3):
        x, m, v, noise = (torch.zeros(shapes[i], dtype=torch.float64) for _ in range(4))
        for t, grads in enumerate(gradients, start=1):
            g = grads[i]
            if t > 1:
                noise = beta2 * noise + (1 - beta2) * (1 + beta1) / 2 * (g - m / (1 - beta1 ** (t - 1))) ** 2
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g**2
            v_hat = v / (1 - beta2**t)
            a = a_of(i, t)
            if a is not None:
                corrected = a / (1 - beta2 ** (k * (t - 2)))
            elif t > 1:
                corrected = v_hat - (1 - 1 / n) * noise / (1 - beta2 ** (t - 1))
            if a is not None or t > 1:
                floored += int((v_hat / floor > corrected).sum())
                v_hat = torch.maximum(corrected, v_hat / floor)
            x = x - lr * (m / (1 - beta1**t)) / (v_hat.sqrt() + eps)
        for run in runs.values():
            torch.testing.assert_close(run[i], x, rtol=0, atol=1e-14)
    assert floored > 0, "the floor should bind somewhere, or floor_ranks is not exercised"


def mean_step(noise_ranks: int, mean: float, std: float, steps: int = 400) -> float:
    """Mean |update| / lr per coordinate over the last half of ``steps`` AccumAdamW steps on
    gradients ``mean + std * N(0, 1)`` (the parameter does not influence them)."""
    param = nn.Parameter(torch.zeros(2000, dtype=torch.float64))
    optimizer = AccumAdamW([param], lr=1.0, betas=(0.9, 0.98), noise_ranks=noise_ranks)
    generator = torch.Generator().manual_seed(0)
    total = 0.0
    for step in range(steps):
        before = param.detach().clone()
        param.grad = mean + std * torch.randn(2000, dtype=torch.float64, generator=generator)
        optimizer.step()
        if step >= steps // 2:
            total += float((param.detach() - before).abs().mean())
    return total / (steps - steps // 2)


def test_noise_ranks_takes_the_step_of_the_mean_of_n_gradients() -> None:
    """Where noise dominates, the step of n=4 is about sqrt(4) times a rank's own Adam step, as
    All-Reduce's over 4 ranks would be; where the mean dominates, it is the same step."""
    noisy = mean_step(4, mean=0.0, std=1.0) / mean_step(1, mean=0.0, std=1.0)
    assert 1.6 < noisy <= 2.0 + 1e-9
    averaged = mean_step(1, mean=0.0, std=0.5) / mean_step(1, mean=0.0, std=1.0)  # std / sqrt(4): same ratio
    assert averaged == pytest.approx(1.0, abs=0.05)
    clean = mean_step(4, mean=1.0, std=0.01) / mean_step(1, mean=1.0, std=0.01)
    assert clean == pytest.approx(1.0, abs=0.01)


def test_accum_steps_4_matches_the_formula() -> None:
    """A separate, plain implementation of docs/guide.md, AccumAdamW, on one flat vector."""
    lr, beta1, beta2, eps, wd, s = 1e-2, 0.9, 0.999, 1e-8, 0.1, 4
    torch.manual_seed(1)
    x0 = torch.randn(50, dtype=torch.float64)
    gradients = [
        torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(30)
    ]

    param = nn.Parameter(x0.clone())
    optimizer = AccumAdamW([param], lr=lr, weight_decay=wd, accum_steps=s)
    for g in gradients:
        param.grad = g.clone()
        optimizer.step()

    x, big_m, big_v, b = (
        x0.clone(),
        torch.zeros(50, dtype=torch.float64),
        torch.zeros(50, dtype=torch.float64),
        0.0,
    )
    for t, g in enumerate(gradients, start=1):
        k = math.ceil(t / s)
        m = beta1 * big_m + (1 - beta1) * g
        v = beta2 * big_v + (1 - beta2) * g**2
        x = x * (1 - lr * wd) - lr * (m / (1 - beta1**k)) / ((v / (1 - beta2**k)).sqrt() + eps)
        b = b + g / s
        if t % s == 0:
            big_m = beta1 * big_m + (1 - beta1) * b
            big_v = beta2 * big_v + (1 - beta2) * b**2
            b = 0.0
    torch.testing.assert_close(param.detach(), x, rtol=0, atol=1e-13)
    assert not torch.equal(x, _adamw_reference(x0, gradients, lr, beta1, beta2, eps, wd)), (
        "s=4 must differ from AdamW"
    )


def _adamw_reference(
    x0: torch.Tensor,
    gradients: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    wd: float,
) -> torch.Tensor:
    param = nn.Parameter(x0.clone())
    optimizer = torch.optim.AdamW([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    for g in gradients:
        param.grad = g.clone()
        optimizer.step()
    return param.detach()


@pytest.mark.parametrize("foreach", [False, True])
def test_state_dict_round_trip_mid_window(foreach: bool) -> None:
    """Save after 6 steps (inside the second window of 4), reload into a fresh optimizer, continue."""
    straight = make_model()
    train(straight, AccumAdamW(groups(straight, 0.1), lr=1e-2, accum_steps=4, foreach=foreach), 14)

    first = make_model()
    optimizer = AccumAdamW(groups(first, 0.1), lr=1e-2, accum_steps=4, foreach=foreach)
    train(first, optimizer, 6)
    saved_model, saved_optimizer = copy.deepcopy(first.state_dict()), copy.deepcopy(optimizer.state_dict())
    state = next(iter(saved_optimizer["state"].values()))
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "grad_accum"}
    assert state["step"].item() == 6 and state["grad_accum"].abs().sum() > 0

    resumed = make_model()
    resumed.load_state_dict(saved_model)
    optimizer = AccumAdamW(groups(resumed, 0.1), lr=1e-2, accum_steps=4, foreach=foreach)
    optimizer.load_state_dict(saved_optimizer)
    train(resumed, optimizer, 8, offset=6)
    torch.testing.assert_close(params_of(resumed), params_of(straight), rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [False, True])
def test_state_dict_round_trip_with_noise_ranks(foreach: bool) -> None:
    straight = make_model()
    train(straight, AccumAdamW(groups(straight, 0.1), lr=1e-2, noise_ranks=8, foreach=foreach), 14)
    first = make_model()
    optimizer = AccumAdamW(groups(first, 0.1), lr=1e-2, noise_ranks=8, foreach=foreach)
    train(first, optimizer, 6)
    saved_model, saved_optimizer = copy.deepcopy(first.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert set(next(iter(saved_optimizer["state"].values()))) == {"step", "exp_avg", "exp_avg_sq", "noise_sq"}
    resumed = make_model()
    resumed.load_state_dict(saved_model)
    optimizer = AccumAdamW(groups(resumed, 0.1), lr=1e-2, noise_ranks=8, foreach=foreach)
    optimizer.load_state_dict(saved_optimizer)
    train(resumed, optimizer, 8, offset=6)
    torch.testing.assert_close(params_of(resumed), params_of(straight), rtol=0, atol=0)


def test_parameters_without_grad_are_skipped() -> None:
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    optimizer = AccumAdamW([used, unused], lr=0.1, accum_steps=2)
    used.grad = torch.ones(3)
    optimizer.step()
    assert torch.equal(unused.detach(), torch.ones(3)) and unused not in optimizer.state
    assert not torch.equal(used.detach(), torch.ones(3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -0.1}, "lr must be >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]"),
        ({"eps": -1.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"accum_steps": 0}, "accum_steps must be an integer >= 1"),
        ({"accum_steps": 2.5}, "accum_steps must be an integer >= 1"),
        ({"noise_ranks": 0}, "noise_ranks must be an integer >= 1"),
        ({"noise_ranks": True}, "noise_ranks must be an integer >= 1"),
        ({"noise_ranks": 4, "accum_steps": 2}, "use accum_steps=1 with it"),
    ],
)
def test_bad_hyperparameters_name_the_problem(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AccumAdamW([nn.Parameter(torch.zeros(1))], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\]"),
        ({"accum_steps": 0}, "accum_steps must be an integer >= 1"),
        ({"accum_steps": 2.0}, "accum_steps must be an integer >= 1"),
    ],
)
@pytest.mark.parametrize("optimizer_class", [AccumAdamW, DecentralizedAdam])
def test_bad_hyperparameters_of_one_param_group_name_the_problem(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, object], match: str
) -> None:
    # values given per group bypass the constructor's arguments: add_param_group checks them too
    good, bad = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=match):
        optimizer_class([{"params": [good]}, {"params": [bad], **group}])
    optimizer = AccumAdamW([good])
    with pytest.raises(ValueError, match=match):
        optimizer.add_param_group({"params": [bad], **group})


def test_step_counter_keeps_counting_past_float32_range() -> None:
    """float32 stops at 2**24: t would stay put and ``t % s == 0`` would commit the moments every step."""
    param = nn.Parameter(torch.zeros(3))
    optimizer = AccumAdamW([param], lr=1e-3, accum_steps=4)
    param.grad = torch.ones(3)
    optimizer.step()
    state = optimizer.state[param]
    assert state["step"].dtype == torch.float64
    state["step"] = torch.tensor(2.0**24, dtype=torch.float32)  # as loaded from an older checkpoint
    state["grad_accum"].zero_()
    committed = []
    for _ in range(8):
        before = state["exp_avg_sq"].clone()
        optimizer.step()
        committed.append(not torch.equal(before, state["exp_avg_sq"]))
    assert state["step"].dtype == torch.float64 and state["step"].item() == 2**24 + 8
    assert committed == [False, False, False, True] * 2  # once per window of 4, at t = 2**24 + 4k
