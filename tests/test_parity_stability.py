"""benchmarks.parity.stability: the thresholds agree with the closed forms of the simplest rules."""

from __future__ import annotations

import pytest

from benchmarks.parity.stability import filtered, rules, threshold


def first_unstable_after(bound: float, found: float, step: float = 0.25) -> bool:
    """``threshold`` returns the first grid point past ``bound`` (where the radius is exactly 1)."""
    return bound < found <= bound + step + 1e-9


@pytest.mark.parametrize("beta1", [0.8, 0.9, 0.95])
def test_thresholds_match_the_closed_forms(beta1: float) -> None:
    found = rules(beta1)
    # heavy ball (All-Reduce's mean): stable while lr * lambda < 2 (1 + b) / (1 - b)
    mean = threshold(found["All-Reduce (mean of the ranks)"])
    assert first_unstable_after(2 * (1 + beta1) / (1 - beta1), mean)
    # a rank's deviation with full mixing: |b - (1 - b) a| < 1, half of All-Reduce's range
    deviation = threshold(found["deviation, own momentum, full mixing"])
    assert first_unstable_after((1 + beta1) / (1 - beta1), deviation)
    gm = threshold(found["deviation, momentum of the mean + own gradient"])
    assert first_unstable_after(1 / (1 - beta1), gm)
    # point_shift: 1 + b - (1 - b) a (1 + b) > 0, the momentum of the mean's range
    shifted = threshold(found["deviation, own momentum, point shifted by b1 x the last deviation"])
    assert first_unstable_after(1 / (1 - beta1), shifted)


def test_lazy_mixing_widens_the_range_and_late_gradients_narrow_it() -> None:
    found = {name: threshold(rule) for name, rule in rules(0.9).items()}
    full = found["deviation, own momentum, full mixing"]
    assert full < found["deviation, own momentum, lazy mixing alpha=0.5"]
    assert (
        found["deviation, own momentum, lazy mixing alpha=0.5"]
        < found["deviation, own momentum, lazy mixing alpha=0.25"]
    )
    assert found["deviation, own momentum, lazy mixing alpha=0.25"] < found["All-Reduce (mean of the ranks)"]
    assert found["mean, gradient one step late (at the mixed weights)"] < 2
    assert found["mean, fresh gradient's share one step late"] < 4


@pytest.mark.parametrize("beta1", [0.8, 0.9, 0.95])
@pytest.mark.parametrize(("c1", "c2"), [(0.0, 0.0), (0.4, -0.5), (0.2, -0.4)])
def test_the_deviation_filter_moves_the_threshold_to_its_closed_form(
    beta1: float, c1: float, c2: float
) -> None:
    """deviation_filter on the complete graph: unstable from (1 + b + c1 - c2) / (1 - b)."""
    found = threshold(filtered(beta1, c1, c2, (True,)), limit=200.0)
    assert first_unstable_after((1 + beta1 + c1 - c2) / (1 - beta1), found)


def test_mixing_every_other_step_narrows_the_range_and_the_filter_widens_it_again() -> None:
    found = {name: threshold(rule) for name, rule in rules(0.9).items()}
    full = found["deviation, own momentum, full mixing"]
    aer = found["deviation, own momentum, mixed every other step (aer over 2 nodes)"]
    assert aer < full
    assert aer < found["deviation, own momentum, filter c1=0.4 c2=-0.5, mixed every other step"] < full
    assert full < found["deviation, own momentum, filter c1=0.4 c2=-0.5, full mixing"]
