"""Linear stability of Adam's momentum dynamics along one curvature direction, per update rule.

Along a Hessian eigen-direction of preconditioned curvature ``lambda`` (Adam's ``P H`` with
``P = 1 / sqrt(v)``), with ``a = lr * lambda`` and momentum ``beta1``, each rule below is a small
linear recurrence; it is stable while the spectral radius of its matrix stays below 1. The
threshold is the smallest ``a`` where it does not (docs/parity.md, "A stability account")::

    python -m benchmarks.parity.stability --beta1 0.9

Rules:
- All-Reduce, the mean of the ranks: ``m' = b m + (1 - b) x``, ``x' = x - a m'`` (heavy ball).
- a rank's deviation from the mean, own momentum, full mixing (``DecentralizedAdam``): its next
  gradient is taken at ``mean - lr P e``, so ``e' = (b - (1 - b) a) e``.
- the same with the momentum of the mean and the rank's own gradient (``gm-oracle``):
  ``d' = -(1 - b) a d``.
- the gradient point shifted towards the mean by ``b1`` times the rank's last deviation
  (``point_shift``): what the deviation keeps at the point is its fresh gradient's share,
  ``e' = b e - (1 - b) a (e - b e_prev)``.
- lazy mixing ``(1 - alpha) I + alpha W``: the deviation keeps ``1 - alpha`` of its position.
- the mean with its next gradient taken one step late (at the mixed weights), or with only the
  fresh gradient's share of the step late.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

Rule = Callable[[float], torch.Tensor]


def radius(matrix: torch.Tensor) -> float:
    return float(torch.linalg.eigvals(matrix).abs().max())


def threshold(rule: Rule, limit: float = 100.0, step: float = 0.25) -> float:
    """The smallest a = lr * lambda (on a grid of ``step``) where ``rule(a)`` is unstable."""
    a = step
    while a < limit:
        if radius(rule(a)) > 1.0 + 1e-9:
            return a
        a += step
    return float("inf")


def rules(b: float) -> dict[str, Rule]:
    def t(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float64)

    def lazy(alpha: float) -> Rule:
        # u: position deviation / (lr P); u' = (1 - alpha) u - e; e' = b e + (1 - b) a u'
        return lambda a: t([[1 - alpha, -1.0], [(1 - b) * a * (1 - alpha), b - (1 - b) * a]])

    return {
        "All-Reduce (mean of the ranks)": lambda a: t([[1 - a * (1 - b), -a * b], [1 - b, b]]),
        "deviation, own momentum, full mixing": lambda a: t([[b - (1 - b) * a]]),
        "deviation, momentum of the mean + own gradient": lambda a: t([[-(1 - b) * a]]),
        # state [e(t), e(t-1)]: the gradient is taken at -(e(t) - b e(t-1)), its fresh share only
        "deviation, own momentum, point shifted by b1 x the last deviation": lambda a: t(
            [[b - (1 - b) * a, (1 - b) * a * b], [1.0, 0.0]]
        ),
        "deviation, own momentum, lazy mixing alpha=0.5": lazy(0.5),
        "deviation, own momentum, lazy mixing alpha=0.25": lazy(0.25),
        # state [x(t+1), x(t), m(t)]: the gradient of step t+1 is taken at x(t)
        "mean, gradient one step late (at the mixed weights)": lambda a: t(
            [[1.0, -a * (1 - b), -a * b], [1.0, 0.0, 0.0], [0.0, 1 - b, b]]
        ),
        # state [x, m, g]: g' = x + a (1 - b) g (the fresh gradient's share of the step not yet taken)
        "mean, fresh gradient's share one step late": lambda a: t(
            [
                [1 - a * (1 - b), -a * b, -a * (1 - b) * a * (1 - b)],
                [1 - b, b, (1 - b) * a * (1 - b)],
                [1.0, 0.0, a * (1 - b)],
            ]
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--beta1", type=float, default=0.9)
    args = parser.parse_args(argv)
    print(f"| rule (beta1 = {args.beta1}) | unstable from lr * lambda = |")
    print("|---|---:|")
    for name, rule in rules(args.beta1).items():
        print(f"| {name} | {threshold(rule):g} |")


if __name__ == "__main__":
    main()
