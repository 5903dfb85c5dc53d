"""The benchmark's command line: what one run does (:class:`Settings`) and how ``--baseline`` reads
All-Reduce's run from an earlier report."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.time_to_quality.methods import BASELINE, DEFAULT_METHODS, METHODS, RANKS_PER_NODE

RESULTS = Path(__file__).resolve().parents[1] / "results"
DESCRIPTION = "Time to the same translation quality on a slow network: All-Reduce against decentralized Adam."
CONTROLLED = (
    "data.path", "train.max_steps", "train.max_minutes", "train.output_dir", "train.eval_every",
    "optim.optimizer", "optim.topology", "optim.local_world_size",
)  # fmt: skip
"""Settings the benchmark sets itself (from its options); an override of one is an error."""


@dataclass(frozen=True)
class Settings:
    """What one benchmark run does (from the command line)."""

    data: str
    steps: int
    eval_every: int
    methods: tuple[str, ...]
    preset: str = "multi30k-en-de"
    overrides: tuple[str, ...] = ()
    link_mbit: float | None = None
    link_how: str = "--link-mbit"
    """Where ``link_mbit`` came from, for the report."""
    comm_ratio: float = 1.5
    calibration_warmup: int = 3
    calibration_steps: int = 12
    work_dir: Path = Path("runs")
    out_dir: Path = RESULTS
    prefix: str = "dcq"
    bleu_args: tuple[str, ...] = ()
    timeout_s: float = 3600.0
    baseline: dict[str, Any] | None = None
    """All-Reduce's run from an earlier report (``--baseline``; its path in ``from``), not trained again."""

    def recipe_overrides(self) -> list[str]:
        """Overrides for every process that reads the recipe's config: the data, then the user's."""
        return [f"data={self.data}", f"train.log_every={self.eval_every}", *self.overrides]

    def run_settings(self) -> list[str]:
        """Overrides that make the trainings comparable: equal steps, no time limit, 2 x 2 ranks."""
        return [
            f"train.max_steps={self.steps}",
            "train.max_minutes=0",
            f"train.eval_every={self.eval_every}",
            f"train.save_every={self.steps}",
            "train.keep_last=1",
            f"optim.local_world_size={RANKS_PER_NODE}",
        ]


def _controlled(key: str) -> bool:
    """Whether ``key`` (``section.key``, ``key`` or ``data``) names a setting the benchmark sets."""
    key = key.strip()
    return key in ("data", "path") or any(key in (name, name.split(".")[1]) for name in CONTROLLED)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """The settings of a run from its arguments; argparse's error (exit 2) for what cannot work."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_quality", description=DESCRIPTION)
    parser.add_argument(
        "--data",
        required=True,
        help="the preset's data directory (for Multi30k: recipes/translation/README.md)",
    )
    parser.add_argument(
        "--steps", type=int, default=450, help="optimizer steps of every method (default 450)"
    )
    parser.add_argument(
        "--eval-every", type=int, help="steps between validation losses (default: steps / 10)"
    )
    parser.add_argument(
        "--methods",
        help=f"comma-separated, of {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)}, without "
        "allreduce with --baseline; the report compares to allreduce)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an earlier run's time_to_quality.json: compare to its All-Reduce run instead of training "
        "one (same preset and overrides; its link rate unless --link-mbit), e.g. to train AER for "
        "as long as All-Reduce took",
    )
    parser.add_argument("--preset", default="multi30k-en-de", help="translation preset (2 x 2 ranks)")
    parser.add_argument("--link-mbit", type=float, help="node link rate instead of the solved one")
    parser.add_argument(
        "--comm-ratio",
        type=float,
        default=1.5,
        help="solve the rate for All-Reduce communication = this x C per iteration (default 1.5)",
    )
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
        "python -m benchmarks.time_to_quality --render JSON [--out-dir DIR] writes a run's report again "
        "from its JSON."
    )
    args = parser.parse_args(argv)

    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    eval_every = args.eval_every if args.eval_every is not None else max(1, args.steps // 10)
    if eval_every < 1:
        parser.error(f"--eval-every must be at least 1, got {eval_every}")
    if args.methods is None:
        args.methods = ",".join(m for m in DEFAULT_METHODS if args.baseline is None or m != BASELINE)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    link_how, baseline = "--link-mbit", None
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown or len(set(methods)) != len(methods):
        parser.error(f"--methods {args.methods!r}: expected distinct names of {', '.join(METHODS)}")
    if args.baseline is not None:
        if BASELINE in methods:
            parser.error(f"--baseline gives the {BASELINE} run: leave {BASELINE} out of --methods")
        baseline, baseline_rate = load_baseline(
            args.baseline, args.preset, tuple(args.overrides), parser.error
        )
        if args.link_mbit is None:
            args.link_mbit, link_how = baseline_rate, f"the rate of --baseline {args.baseline}"
    if args.link_mbit is not None and not args.link_mbit > 0:
        parser.error(f"--link-mbit must be > 0, got {args.link_mbit}")
    if not args.comm_ratio > 0:
        parser.error(f"--comm-ratio must be > 0, got {args.comm_ratio}")
    if args.calibration_steps < 1 or args.calibration_warmup < 0:
        parser.error("--calibration-steps must be >= 1 and --calibration-warmup >= 0")
    for item in args.overrides:
        if "=" not in item:
            parser.error(f"override {item!r} is not KEY=VALUE (e.g. optim.accum_steps=2)")
        if _controlled(item.split("=", 1)[0]):
            parser.error(
                f"override {item!r}: the benchmark sets that itself "
                "(use --data, --steps, --eval-every, --methods)"
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
        preset=args.preset,
        overrides=tuple(args.overrides),
        link_mbit=args.link_mbit,
        link_how=link_how,
        comm_ratio=args.comm_ratio,
        calibration_warmup=args.calibration_warmup,
        calibration_steps=args.calibration_steps,
        work_dir=work_dir.resolve(),
        out_dir=args.out_dir,
        prefix=args.prefix,
        bleu_args=tuple(args.bleu_arg),
        timeout_s=timeout_min * 60,
        baseline=baseline,
    )


def load_baseline(
    path: Path, preset: str, overrides: tuple[str, ...], error: Callable[[str], NoReturn]
) -> tuple[dict[str, Any], float]:
    """The All-Reduce run of an earlier report (``--baseline``), marked with the file and the
    report's command, and the report's link rate; ``error`` (argparse's) if the file is not such a
    report or was made with other settings."""
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as reason:
        error(f"--baseline {path}: cannot read it ({reason})")
    run = report.get("runs", {}).get(BASELINE) if isinstance(report, dict) else None
    if not isinstance(run, dict) or not run.get("curve"):
        error(f"--baseline {path}: no {BASELINE} run with a validation curve in it")
    if (report.get("preset"), tuple(report.get("overrides", ()))) != (preset, overrides):
        error(
            f"--baseline {path}: made with --preset {report.get('preset')} and overrides "
            f"{' '.join(report.get('overrides', ())) or '(none)'}; give the same ones to compare"
        )
    marked = {
        **run,
        "from": str(path),
        "command": report.get("command", "?"),
        "steps": run.get("steps", report.get("steps")),
    }
    return marked, float(report["link"]["rate_mbit"])
