"""The command line of a recipe's ``train.py``, and bad input reported as one line.

Every recipe takes the same flags: ``--preset NAME`` (a file of the recipe's ``presets/`` or a
``.toml`` path), the shortcuts ``--optimizer``, ``--setting``, ``--topology``, ``--accum-steps``,
``--local-world-size``, ``--output-dir`` and ``--log-format`` for the ``optim.*``,
``train.output_dir`` and ``train.log_format`` settings,
``--resume [auto|must]`` (a bare ``--resume`` is ``must``; see
:meth:`recipes.common.run.RunDirectory.resume_from`), and ``section.key=value`` overrides before or
after them (:mod:`recipes.common.config`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from recipes.common.config import Presets
from recipes.common.progress import LOG_FORMATS

__all__ = ["exit_on_bad_input", "parse"]

C = TypeVar("C")
RESUME_CHOICES = ("auto", "must")


def parse(
    module: str,
    description: str,
    presets: Presets[C],
    optimizers: tuple[str, ...],
    argv: list[str] | None = None,
) -> tuple[argparse.Namespace, C]:
    """The parsed flags of ``python -m MODULE`` and the effective config: defaults < preset <
    overrides < flags."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", required=True, help=f"one of {', '.join(presets.names())}, or a .toml")
    parser.add_argument("--optimizer", choices=optimizers, help="default: the preset's optim.optimizer")
    parser.add_argument(
        "--setting", help="DecentralizedAdam's setting, a name of decentadam.SETTINGS (optim.setting)"
    )
    parser.add_argument("--topology", help="decentralized graph (optim.topology)")
    parser.add_argument("--accum-steps", type=int, help="AccumAdam window s (optim.accum_steps)")
    parser.add_argument("--local-world-size", type=int, help="ranks per node (optim.local_world_size)")
    parser.add_argument("--output-dir", help="run directory (train.output_dir)")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="progress on stderr (train.log_format): a bar on a terminal, else one text line per log step "
        "(auto, the default), or always bar, text, or json lines",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        choices=RESUME_CHOICES,
        const="must",
        default="none",
        help="continue from the run directory's newest complete checkpoint: 'must' (the default of a bare "
        "--resume) refuses a directory without one, 'auto' then starts a new run (for restarts by "
        "torchrun --max-restarts or accelerate launch --max_restarts)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.max_steps=200 data=DIR")
    # A bare --resume followed by an override (--resume data=DIR) must not take it for its value.
    given = list(sys.argv[1:] if argv is None else argv)
    following = [*given[1:], None]
    given = [
        "--resume=must" if arg == "--resume" and after not in RESUME_CHOICES else arg
        for arg, after in zip(given, following, strict=True)
    ]
    args = parser.parse_intermixed_args(given)  # overrides may come before and after flags
    flags = {
        "optim.optimizer": args.optimizer,
        "optim.setting": args.setting,
        "optim.topology": args.topology,
        "optim.accum_steps": args.accum_steps,
        "optim.local_world_size": args.local_world_size,
        "train.output_dir": args.output_dir,
        "train.log_format": args.log_format,
    }
    overrides = list(args.overrides) + [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    return args, presets.load(args.preset, overrides)


def exit_on_bad_input(
    main: Callable[[], None],
    errors: tuple[type[Exception], ...],
    *,
    any_rank: tuple[type[Exception], ...] = (),
) -> None:
    """Run ``main``; one of ``errors`` ends it with ``error: MESSAGE`` on stderr and exit code 2.

    Every rank meets bad configuration and data alike, so only rank 0 prints it (one line, not a
    traceback per rank); an error of ``any_rank`` (met by one rank only) is printed by the rank that
    met it.
    """
    try:
        main()
    except errors as error:
        if os.environ.get("RANK", "0") == "0" or isinstance(error, any_rank):
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
