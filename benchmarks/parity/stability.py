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
- the group mixed every other step only (``aer`` over 2 nodes): on the resting step the deviation
  keeps its position and adds the step, ``p' = p - e'``; the rule is the two steps' product.
- ``deviation_filter``'s filter of the known deviations, ``phi = b phi + c1 k(t) + c2 k(t-1)``
  added to the direction, with ``k(t)`` the deviation the mixing revealed (0 on a resting step):
  on the complete graph ``e' = (b + c1 - (1 - b) a) e + c2 e_prev``, stable while
  ``a < (1 + b + c1 - c2) / (1 - b)`` (and ``b + c1 + c2 < 1``, ``|c2| < 1``).
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


def filtered(b: float, c1: float, c2: float, mixed: tuple[bool, ...]) -> Rule:
    """A rank's deviation under ``deviation_filter``'s filter ``(c1, c2)`` (``(0, 0)``: none), its
    group mixed on the steps where ``mixed`` is true (repeating): the product over one period.

    State ``[p, e, phi, k_prev]``: the position deviation at the gradient point (in units of
    ``lr P``), the momentum's deviation, the filter and the last revealed deviation."""

    def rule(a: float) -> torch.Tensor:
        product = torch.eye(4, dtype=torch.float64)
        for mix in mixed:
            p, e, phi, k_prev = torch.eye(4, dtype=torch.float64)
            known = -p if mix else torch.zeros(4, dtype=torch.float64)  # k(t) = mix - x = -p
            e_next = b * e + (1 - b) * a * p
            phi_next = b * phi + c1 * known + c2 * k_prev
            p_next = (0.0 if mix else 1.0) * p - (e_next + phi_next)
            product = torch.stack([p_next, e_next, phi_next, known]) @ product
        return product

    return rule


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
        "deviation, own momentum, mixed every other step (aer over 2 nodes)": filtered(
            b, 0, 0, (False, True)
        ),
        "deviation, own momentum, filter c1=0.4 c2=-0.5, full mixing": filtered(b, 0.4, -0.5, (True,)),
        "deviation, own momentum, filter c1=0.4 c2=-0.5, mixed every other step": filtered(
            b, 0.4, -0.5, (False, True)
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
