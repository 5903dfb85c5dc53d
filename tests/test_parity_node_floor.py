"""benchmarks.parity.node_floor: the nodes' second moment with its floor at V / N**2."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from benchmarks.parity.node_floor import NodeFloorAdam, floor_update
from benchmarks.parity.node_shared_a import shared_a_update
from decentadam.optim.accum_adamw import step_group

BETA1, BETA2, EPS, LR, WD = 0.9, 0.98, 1e-9, 1e-2, 0.01


def nodes_state(foreach: bool) -> tuple[torch.Tensor, dict[torch.Tensor, dict[str, Any]], dict[str, Any]]:
    """A parameter after 4 steps of 2 nodes' group-gradient Adam (A folded in 5 times), its next
    gradient, and its group (noise_ranks N = 2). A spans the three bands: below V / 4, between V / 4
    and V / 2, above V / 2 (bias-corrected)."""
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(60, generator=generator, dtype=torch.float64)
    param.grad = torch.randn(60, generator=generator, dtype=torch.float64)
    second = torch.rand(60, generator=generator, dtype=torch.float64) + 2.0
    share = torch.tensor([0.1, 0.35, 0.9], dtype=torch.float64).repeat(20)  # A_hat / V_hat at step 4
    correction_v, correction_a = 1 - BETA2**4, 1 - BETA2**5
    state = {
        param: {
            "step": torch.tensor(4.0, dtype=torch.float64),
            "exp_avg": torch.randn(60, generator=generator, dtype=torch.float64) * 0.1,
            "exp_avg_sq": second * correction_v,
            "group_sq": share * second * correction_a,
            "group_updates": 5,
        }
    }
    group = {
        "lr": LR,
        "betas": (BETA1, BETA2),
        "eps": EPS,
        "weight_decay": WD,
        "accum_steps": 1,
        "foreach": foreach,
        "noise_ranks": 2,
        "v_every": 1,
    }
    return param, state, group


def expected_step(param: torch.Tensor, st: dict[str, Any], floor: int) -> torch.Tensor:
    """Step 5 written out: v = max(A_hat, V_hat / floor)."""
    g = param.grad
    assert g is not None
    m = BETA1 * st["exp_avg"] + (1 - BETA1) * g
    v = BETA2 * st["exp_avg_sq"] + (1 - BETA2) * g * g
    a_hat = st["group_sq"] / (1 - BETA2**5)
    denominator = torch.maximum(a_hat, v / (1 - BETA2**5) / floor).sqrt() + EPS
    step: torch.Tensor = param * (1 - LR * WD) - LR / (1 - BETA1**5) * m / denominator
    return step


@pytest.mark.parametrize("foreach", [False, True])
def test_the_floor_is_v_over_n_squared_for_this_step_only(foreach: bool) -> None:
    param, state, group = nodes_state(foreach)
    before = {key: value.clone() if torch.is_tensor(value) else value for key, value in state[param].items()}
    expected, library = expected_step(param, before, floor=4), expected_step(param, before, floor=2)
    with torch.no_grad():
        floor_update(state, group, [param])
    torch.testing.assert_close(param, expected, rtol=1e-12, atol=1e-15)
    assert group["noise_ranks"] == 2  # the library's N is back
    above = torch.arange(60) % 3 == 2  # A_hat > V/2: neither floor binds
    assert torch.all((expected - library)[~above].abs() > 1e-6)  # below V/2 the floor V/4 steps further
    torch.testing.assert_close(expected[above], library[above], rtol=1e-12, atol=1e-15)
    # the library's own step, for contrast, is the floor V / 2
    param2, state2, group2 = nodes_state(foreach)
    with torch.no_grad():
        step_group(state2, group2, [param2])
    torch.testing.assert_close(param2, library, rtol=1e-12, atol=1e-15)


def test_the_group_keeps_its_noise_ranks_when_the_step_fails() -> None:
    param, state, group = nodes_state(False)

    def failing(*args: Any) -> None:
        assert group["noise_ranks"] == 4
        raise RuntimeError("inner step failed")

    with pytest.raises(RuntimeError, match="inner step failed"):
        floor_update(state, group, [param], inner=failing)
    assert group["noise_ranks"] == 2


@pytest.mark.parametrize("every", [None, "3"])
def test_the_optimizer_wraps_the_library_step_or_the_shared_a_step(
    every: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if every is None:
        monkeypatch.delenv("DECENTADAM_SHARED_A_EVERY", raising=False)
    else:
        monkeypatch.setenv("DECENTADAM_SHARED_A_EVERY", every)
    model = torch.nn.Linear(3, 2)
    optimizer = NodeFloorAdam(model.parameters(), lr=LR, second_moment="group_gradient")
    update = optimizer._local_update
    assert isinstance(update, functools.partial) and update.func is floor_update
    inner = update.keywords["inner"]
    if every is None:
        assert inner is step_group
    else:
        assert inner.func is shared_a_update and inner.keywords == {"every": 3}
    optimizer.close()
    plain = NodeFloorAdam(model.parameters(), lr=LR)  # all_ranks: nothing to floor differently
    assert plain._local_update is step_group
    plain.close()
