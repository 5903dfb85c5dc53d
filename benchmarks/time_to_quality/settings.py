"""The benchmark's command line: what one run does (:class:`Settings`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.time_to_quality.methods import BASELINE, BEST, DEFAULT_METHODS, METHODS, RANKS_PER_NODE
from decentadam.options import FLAT_OPTIONS, SETTINGS

RESULTS = Path(__file__).resolve().parents[1] / "results" / "time_to_quality"
DESCRIPTION = (
    "Time to the same translation quality on a slow network: DecentralizedAdam against float32 DDP and "
    "what a user would pick instead, every method in one run."
)
CONTROLLED = (
    "data.path", "train.max_steps", "train.max_minutes", "train.output_dir", "train.eval_every",
    "train.save_every", "train.keep_last", "train.seed", "optim.optimizer", "optim.lr", "optim.setting",
    "optim.local_world_size", *(f"optim.{name}" for name in FLAT_OPTIONS),
)  # fmt: skip
"""Settings the benchmark sets itself (from its options); an override of one is an error."""


@dataclass(frozen=True)
class Settings:
    """What one benchmark run does (from the command line)."""

    data: str
    steps: int
    """All-Reduce's steps; every other method trains for All-Reduce's training time of its seed."""
    eval_every: int
    methods: tuple[str, ...]
    seeds: tuple[int, ...] = (1, 2)
    best: str | None = None
    """The setting (a name of ``decentadam.SETTINGS``) of ``decentadam-best``."""
    lrs: tuple[float, ...] = ()
    """The learning rates every method trains with (each method's best by its mean final validation
    loss is reported); empty: the preset's."""
    preset: str = "multi30k-en-de"
    overrides: tuple[str, ...] = ()
    link_mbit: float | None = None
    comm_ratio: float = 1.5
    calibration_warmup: int = 3
    calibration_steps: int = 12
    work_dir: Path = Path("runs")
    out_dir: Path = RESULTS
    prefix: str = "dcq"
    bleu_args: tuple[str, ...] = ()
    timeout_s: float = 3600.0
    max_steps: int = 0
    """The most steps a method that trains for All-Reduce's time may take (0: 3 x ``steps``)."""

    @property
    def step_cap(self) -> int:
        """:attr:`max_steps`, or 3 x ``steps`` where it is 0."""
        return self.max_steps or 3 * self.steps

    def recipe_overrides(self) -> list[str]:
        """Overrides for every process that reads the recipe's config: the data, then the user's."""
        return [f"data={self.data}", f"train.log_every={self.eval_every}", *self.overrides]

    def run_settings(self, seed: int, lr: float | None, budget_s: float | None = None) -> list[str]:
        """Overrides that make the trainings comparable: 2 x 2 ranks, a checkpoint at every evaluation
        (BLEU in All-Reduce's training time), the seed, the rate; and how long to train: ``steps``
        steps (All-Reduce, or where ``budget_s`` is None), else until ``budget_s`` seconds of training
        (All-Reduce's of the seed; checked at each evaluation) or :attr:`step_cap` steps, whichever
        comes first. The recipe's schedule does not depend on the steps (inverse square root after
        the warm-up), so a longer run follows the same rates."""
        if budget_s is None:
            length = [f"train.max_steps={self.steps}", "train.max_minutes=0"]
        else:
            length = [f"train.max_steps={self.step_cap}", f"train.max_minutes={budget_s / 60:.6g}"]
        return [
            *length,
            f"train.eval_every={self.eval_every}",
            f"train.save_every={self.eval_every}",
            "train.keep_last=0",
            f"train.seed={seed}",
            f"optim.local_world_size={RANKS_PER_NODE}",
            *([] if lr is None else [f"optim.lr={lr:g}"]),
        ]


def _controlled(key: str) -> bool:
    """Whether ``key`` (``section.key``, ``key`` or ``data``) names a setting the benchmark sets."""
    key = key.strip()
    return key in ("data", "path") or any(key in (name, name.split(".")[1]) for name in CONTROLLED)


def _numbers(text: str, kind: type[int] | type[float], option: str, error: argparse.ArgumentParser) -> list:  # type: ignore[type-arg]
    try:
        return [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        error.error(f"{option} {text!r}: expected comma-separated numbers")


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """The settings of a run from its arguments; argparse's error (exit 2) for what cannot work."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_quality", description=DESCRIPTION)
    parser.add_argument(
        "--data", required=True, help="the preset's data directory (recipes/translation/README.md)"
    )
    parser.add_argument(
        "--steps", type=int, default=1200,
        help="All-Reduce's optimizer steps (default 1200); every other method trains for All-Reduce's "
        "training time of its seed",
    )  # fmt: skip
    parser.add_argument(
        "--max-steps", type=int, default=0,
        help="the most steps a method may take within All-Reduce's time (default: 3 x --steps)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-every", type=int, help="steps between validation losses (default: steps / 12)"
    )
    parser.add_argument(
        "--methods", help=f"comma-separated, of {', '.join(METHODS)} (default: all; {BASELINE} is needed)"
    )
    parser.add_argument("--seeds", default="1,2", help="comma-separated recipe seeds (default 1,2)")
    parser.add_argument(
        "--best", choices=sorted(SETTINGS), help=f"the setting of {BEST} (needed when it is among --methods)"
    )
    parser.add_argument(
        "--lr-grid",
        help="comma-separated learning rates: every method trains with each, and each method's rate with "
        "the lowest mean final validation loss is reported (default: the preset's rate only)",
    )
    parser.add_argument("--preset", default="multi30k-en-de", help="translation preset (2 x 2 ranks)")
    parser.add_argument("--link-mbit", type=float, help="node link rate instead of the solved one")
    parser.add_argument(
        "--comm-ratio", type=float, default=1.5,
        help="solve the rate for All-Reduce communication = this x C per iteration (default 1.5)",
    )  # fmt: skip
    parser.add_argument("--calibration-steps", type=int, default=12, help="timed steps (default 12)")
    parser.add_argument("--calibration-warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="run directories (default: runs/time-to-quality-<UTC time>; new or empty)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="report directory")
    parser.add_argument("--prefix", default="dcq", help="network namespace name prefix")
    parser.add_argument("--bleu-arg", action="append", default=[], help="passed to eval.bleu (repeatable)")
    parser.add_argument("--timeout-min", type=float, help="per training (default: 10 min + 20 s per step)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every method")
    parser.epilog = (
        "python -m benchmarks.time_to_quality --render JSON [--out-dir DIR] writes a run's report again; "
        "--predict-scale RUNS [--out-dir DIR] predicts time to quality at scale "
        "(benchmarks.time_to_quality.scale)."
    )
    args = parser.parse_args(argv)

    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.max_steps and args.max_steps < args.steps:
        parser.error(f"--max-steps {args.max_steps} is below --steps {args.steps}: give at least --steps")
    eval_every = args.eval_every if args.eval_every is not None else max(1, args.steps // 12)
    if eval_every < 1:
        parser.error(f"--eval-every must be at least 1, got {eval_every}")
    methods = tuple(m.strip() for m in (args.methods or ",".join(DEFAULT_METHODS)).split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown or len(set(methods)) != len(methods):
        parser.error(f"--methods {args.methods!r}: expected distinct names of {', '.join(METHODS)}")
    if BASELINE not in methods:
        parser.error(f"--methods {args.methods!r}: every comparison is to {BASELINE}; include it")
    if BEST in methods and args.best is None:
        parser.error(
            f"{BEST} needs --best NAME (one of {', '.join(sorted(SETTINGS))}), or leave it out of --methods"
        )
    seeds = tuple(_numbers(args.seeds, int, "--seeds", parser))
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds {args.seeds!r}: expected distinct integers, e.g. 1,2")
    lrs = tuple(_numbers(args.lr_grid, float, "--lr-grid", parser)) if args.lr_grid else ()
    if any(not lr > 0 for lr in lrs) or len(set(lrs)) != len(lrs):
        parser.error(f"--lr-grid {args.lr_grid!r}: expected distinct rates > 0, e.g. 1e-3,2e-3")
    if args.link_mbit is not None and not args.link_mbit > 0:
        parser.error(f"--link-mbit must be > 0, got {args.link_mbit}")
    if not args.comm_ratio > 0:
        parser.error(f"--comm-ratio must be > 0, got {args.comm_ratio}")
    if args.calibration_steps < 1 or args.calibration_warmup < 0:
        parser.error("--calibration-steps must be >= 1 and --calibration-warmup >= 0")
    for item in args.overrides:
        if "=" not in item:
            parser.error(f"override {item!r} is not KEY=VALUE (e.g. model.dropout=0.2)")
        if _controlled(item.split("=", 1)[0]):
            parser.error(
                f"override {item!r}: the benchmark sets that itself (use --data, --steps, --eval-every, "
                "--seeds, --lr-grid, --best)"
            )
    data = Path(args.data)
    if not data.is_dir():
        parser.error(f"--data {args.data}: not a directory")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    work_dir = args.work_dir if args.work_dir is not None else Path("runs") / f"time-to-quality-{stamp}"
    if work_dir.exists() and any(work_dir.iterdir()):
        parser.error(f"--work-dir {work_dir} is not empty")
    timeout_min = args.timeout_min if args.timeout_min is not None else 10 + args.steps / 3
    return Settings(
        data=str(data.resolve()),
        steps=args.steps,
        eval_every=eval_every,
        methods=methods,
        seeds=seeds,
        best=args.best,
        lrs=lrs,
        preset=args.preset,
        overrides=tuple(args.overrides),
        link_mbit=args.link_mbit,
        comm_ratio=args.comm_ratio,
        calibration_warmup=args.calibration_warmup,
        calibration_steps=args.calibration_steps,
        work_dir=work_dir.resolve(),
        out_dir=args.out_dir,
        prefix=args.prefix,
        bleu_args=tuple(args.bleu_arg),
        timeout_s=timeout_min * 60,
        max_steps=args.max_steps,
    )
