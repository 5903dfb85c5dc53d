"""Oracle of the parity study: do the All-Reduce and decentralized paths of the recipe agree?

Trains the translation recipe twice on the same seed, data and steps: All-Reduce (DDP + AdamW),
and ``DecentralizedAdam`` on the complete graph with ``accum_steps=1``, ``second_moment='local'``
(the gradient it sees is already the mean), All-Reduce's betas and
every rank's gradient replaced by the mean over all ranks before each step
(``benchmarks.parity.mean_gradients``). That second run is All-Reduce AdamW computed another way,
so its training losses must equal the first run's up to floating-point summation order for the
first steps, and its validation curve must stay on the first's. A difference would mean that
something other than the optimizer differs between the paths (data, schedule, loss
normalisation, evaluation), which must be fixed before comparing optimizers::

    python -m benchmarks.parity.oracle --preset multi30k-en-de --data MULTI30K --steps 400 \\
        --out runs/parity-oracle optim.lr=2e-3

writes ``OUT/oracle.json`` (commands, per-step training losses, validation curves) and
``OUT/oracle.md``. Extra ``key=value`` arguments go to both trainings.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from recipes.common.launch import accelerate_launch, environment, run_logged
from recipes.translation.compare import curve

RUNS = {
    "allreduce": ("recipes.translation.train", ["--optimizer", "allreduce"]),
    "mean_gradients": (
        "benchmarks.parity.mean_gradients",
        [
            "--optimizer",
            "decentralized",
            "optim.topology=complete",
            "optim.accum_steps=1",
            "optim.second_moment=local",
        ],
    ),
}


def train_losses(run: Path) -> dict[int, float]:
    """``train/loss`` of every logged step, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses: dict[int, float] = {}
    for events in sorted((run / "tb").rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "train/loss" in accumulator.Tags()["scalars"]:
            losses.update({e.step: e.value for e in accumulator.Scalars("train/loss")})
    return losses


def compare_runs(report: dict[str, Any], first_steps: int) -> dict[str, Any]:
    """Per-step loss differences over the first steps and the largest validation difference."""
    reference, oracle = (report["runs"][name] for name in RUNS)
    steps = sorted(set(reference["train_loss"]) & set(oracle["train_loss"]))
    relative = [
        abs(oracle["train_loss"][s] - reference["train_loss"][s]) / abs(reference["train_loss"][s])
        for s in steps
    ]
    valid_ref = {p["step"]: p["valid_nll"] for p in reference["curve"]}
    valid_diff = {
        p["step"]: p["valid_nll"] - valid_ref[p["step"]] for p in oracle["curve"] if p["step"] in valid_ref
    }
    return {
        "first_steps": first_steps,
        "max_relative_loss_difference_first_steps": max(relative[:first_steps], default=float("nan")),
        "max_relative_loss_difference_all": max(relative, default=float("nan")),
        "valid_nll_difference": valid_diff,
        "max_abs_valid_nll_difference": max((abs(d) for d in valid_diff.values()), default=float("nan")),
    }


def render(report: dict[str, Any]) -> str:
    result = report["result"]
    reference, oracle = (report["runs"][name] for name in RUNS)
    valid_ref = {p["step"]: p["valid_nll"] for p in reference["curve"]}
    lines = [
        "# Parity oracle: All-Reduce against DecentralizedAdam fed the all-reduced gradient",
        "",
        f"Command: `{report['command']}`",
        "",
        f"- training loss, first {result['first_steps']} steps: largest relative difference "
        f"{result['max_relative_loss_difference_first_steps']:.2e}",
        f"- training loss, all {len(oracle['train_loss'])} logged steps: largest relative difference "
        f"{result['max_relative_loss_difference_all']:.2e}",
        f"- validation NLL: largest difference {result['max_abs_valid_nll_difference']:.4f} nats",
        "",
        "| step | All-Reduce valid NLL | mean-gradient DecentralizedAdam | difference |",
        "|---:|---:|---:|---:|",
    ]
    for point in oracle["curve"]:
        step = point["step"]
        if step in valid_ref:
            lines.append(
                f"| {step} | {valid_ref[step]:.4f} | {point['valid_nll']:.4f} | "
                f"{point['valid_nll'] - valid_ref[step]:+.4f} |"
            )
    lines += ["", "Runs: " + "; ".join(f"`{shlex.join(r['command'])}`" for r in report["runs"].values()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--data", required=True, help="the preset's data directory")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--first-steps", type=int, default=10, help="steps whose losses must agree closely")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable, "-m", __spec__.name, *(argv or sys.argv[1:])])
    }
    report["runs"] = {}
    common = [
        "--preset", args.preset, f"data={args.data}", f"train.max_steps={args.steps}", "train.max_minutes=0",
        "train.log_every=1", f"train.eval_every={args.eval_every}", f"train.save_every={args.steps}",
        "train.keep_last=1", *args.overrides,
    ]  # fmt: skip
    for name, (module, flags) in RUNS.items():
        run = args.out / name
        command = [*accelerate_launch(module, args.processes), *common, *flags, f"train.output_dir={run}"]
        # the decentralized run takes All-Reduce's betas: with them its AdamW step is All-Reduce's
        if name == "mean_gradients":
            command.append(f"optim.betas_decentralized={_betas_allreduce(args)}")
        run_logged(command, args.out / f"{name}.log", name, env=environment())
        report["runs"][name] = {"command": command, "curve": curve(run), "train_loss": train_losses(run)}
    report["result"] = compare_runs(report, args.first_steps)
    (args.out / "oracle.json").write_text(json.dumps(report, indent=1))
    (args.out / "oracle.md").write_text(render(report))
    print(render(report))


def _betas_allreduce(args: argparse.Namespace) -> str:
    from recipes.translation import config

    cfg = config.load(args.preset, [f"data={args.data}", *args.overrides])
    return json.dumps(list(cfg.optim.betas_allreduce))


if __name__ == "__main__":
    main()
