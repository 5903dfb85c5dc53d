"""The translation recipe's command line with a probe's optimizer in place of DecentralizedAdam.

Each probe of this package that changes the optimizer runs the recipe through
:func:`run_recipe`, so that it trains, evaluates and saves exactly as ``recipes.translation.train``
does, with the probe's subclass wherever the recipe builds ``decentadam.DecentralizedAdam``;
:func:`period_from_env` reads a probe's period (``DECENTADAM_*_EVERY``) so that bad input fails
before training starts. With ``DECENTADAM_MEAN_WEIGHTS=1`` any probe runs at one point for all
ranks (:mod:`benchmarks.parity.mean_weights`: every rank's parameters averaged after each step).
"""

from __future__ import annotations

import os

import decentadam


def run_recipe(
    optimizer_class: type[decentadam.DecentralizedAdam] | None = None, *, one_point: bool = False
) -> None:
    """``recipes.translation.train``'s ``main``, bad input reported as the recipe reports it; with
    ``one_point`` (or ``DECENTADAM_MEAN_WEIGHTS=1``) every rank's parameters averaged after each step."""
    from recipes.common import cli
    from recipes.common.config import ConfigError
    from recipes.translation import data, train

    switch = os.environ.get("DECENTADAM_MEAN_WEIGHTS", "0")
    if switch not in ("0", "1"):
        raise ValueError(f"DECENTADAM_MEAN_WEIGHTS must be 0 or 1, got {switch!r}")
    if one_point or switch == "1":
        from benchmarks.parity.mean_weights import install

        install()
    if optimizer_class is not None:
        decentadam.DecentralizedAdam = optimizer_class  # type: ignore[misc]  # what build_optimizer builds
    cli.exit_on_bad_input(train.main, (ConfigError, data.DataError))


def period_from_env(variable: str, default: int = 2) -> int:
    """A probe's period in steps from the environment variable ``variable`` (an integer >= 1)."""
    text = os.environ.get(variable, str(default))
    try:
        every = int(text)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(f"{variable} must be an integer >= 1, got {text!r}")
    return every
