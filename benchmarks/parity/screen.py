"""Many simulated 4-rank runs of the translation recipe at once, on one GPU: a screen, and its table.

Each run is :mod:`benchmarks.parity.workers` (4 simulated ranks in one process, 2 nodes x 2, the
library's own update code), its output one JSON line per evaluation in ``OUT/NAME.log``. All runs
of a screen start together (one process each, ``OMP_NUM_THREADS=1``); at ``--deadline`` seconds
the unfinished ones are stopped, so the table shows how far each got. Then ``OUT/screen.md``: the
validation NLL at every evaluation and its difference to All-Reduce's with the same language and
seed. A screen picks candidates; a claim is then checked with the recipe (docs/results/)::

    python -m benchmarks.parity.screen --screen lr --data MULTI30K --device cuda \\
        --steps 1200 --deadline 430 --out runs/screen

``--table-only`` rebuilds the table from the logs in ``OUT``. (The screens' runs of a deviation
filter, a probe that did not become a setting, are at the git tag ``parity-probes-archive``.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.parity.workers_table import nll_cell

NODES = ["optim.intra_node=all_reduce", "optim.second_moment=group_gradient"]
LRS = ("1e-3", "2e-3", "4e-3")


def run(lang: str, optimizer: str, *extra: str) -> list[str]:
    """The arguments of benchmarks.parity.workers of one run."""
    args = ["--preset", f"multi30k-en-{lang}", "--optimizer", optimizer]
    if optimizer == "decentralized":
        args += NODES
    return [*args, *extra]


SCREENS: dict[str, dict[str, list[str]]] = {
    # the lr grid of both methods and the nodes' graph
    "lr": {
        **{f"de-ar-{lr}": run("de", "allreduce", f"optim.lr={lr}") for lr in LRS},
        **{f"de-node-aer-{lr}": run("de", "decentralized", f"optim.lr={lr}") for lr in LRS},
        "de-node-complete-2e-3": run("de", "decentralized", "optim.topology=complete"),
        "fr-ar-2e-3": run("fr", "allreduce"),
        "fr-node-aer-2e-3": run("fr", "decentralized"),
    },
    # a second seed, En-Fr's complete graph
    "seeds": {
        "de-ar-s2": run("de", "allreduce", "train.seed=2"),
        "de-node-aer-s2": run("de", "decentralized", "train.seed=2"),
        "fr-node-complete": run("fr", "decentralized", "optim.topology=complete"),
    },
    # four seeds of All-Reduce and the nodes on aer to 1,200 steps (with --bleu: their test BLEU),
    # and two of the nodes on complete (what the nodes' exchange at every step would give)
    "seeds-1200": {
        **{
            f"de-{name}-s{seed}": run("de", optimizer, *extra, f"train.seed={seed}")
            for name, optimizer, extra in (
                ("ar", "allreduce", ()),
                ("node-aer", "decentralized", ()),
            )
            for seed in (1, 2, 3, 4)
        },
        **{
            f"de-node-complete-s{seed}": run(
                "de", "decentralized", "optim.topology=complete", f"train.seed={seed}"
            )
            for seed in (1, 2)
        },
    },
    # the chosen setting (the nodes on complete with bfloat16 updates, aer's inter-node bytes) with
    # four seeds on En-De and two on En-Fr, beside All-Reduce with the same seeds, with --bleu
    "bf16-seeds-1200": {
        **{
            f"{lang}-{name}-s{seed}": run(lang, optimizer, *extra, f"train.seed={seed}")
            for lang, seeds in (("de", (1, 2, 3, 4)), ("fr", (1,)))
            for name, optimizer, extra in (
                ("ar", "allreduce", ()),
                ("node-bf16", "decentralized", ("optim.topology=complete", "optim.exchange=bf16_updates")),
            )
            for seed in seeds
        },
    },
    # the chosen setting with the nodes' second moment shared (share_second_moment_every=2; off by
    # default), four En-De and three En-Fr seeds, and All-Reduce
    # on the En-Fr seeds that bf16-seeds-1200 did not run (its simulated runs are bitwise the same
    # in every screen: copy its de-ar-s*.log and fr-ar-s1.log into --out for the table's differences)
    "shared-seeds-1200": {
        **{
            f"{lang}-node-shared-s{seed}": run(
                lang,
                "decentralized",
                "optim.topology=complete",
                "optim.exchange=bf16_updates",
                "optim.share_second_moment_every=2",
                f"train.seed={seed}",
            )
            for lang, seeds in (("de", (1, 2, 3, 4)), ("fr", (1, 2, 3)))
            for seed in seeds
        },
        **{f"fr-ar-s{seed}": run("fr", "allreduce", f"train.seed={seed}") for seed in (2, 3)},
    },
}


def read_curve(log: Path) -> dict[int, float]:
    """Step -> validation NLL from a run's log (the JSON lines benchmarks.parity.workers prints)."""
    curve = {}
    for line in log.read_text().splitlines():
        if line.startswith('{"step"'):
            point = json.loads(line)
            curve[point["step"]] = point["valid_nll"]
    return curve


def read_bleu(log: Path) -> float | None:
    """The test BLEU a run's log ends with (``--bleu``), if it got there."""
    for line in log.read_text().splitlines():
        if line.startswith('{"bleu"'):
            return float(json.loads(line)["bleu"])
    return None


def reference_of(name: str, names: list[str]) -> str | None:
    """All-Reduce at lr 2e-3 with the same language and seed, if the logs have it (seed 1 is the
    name without ``-sN``, or ``-s1``)."""
    lang, _, tail = name.partition("-")
    seed = tail.rpartition("-")[2] if re.fullmatch(r".*-s\d+", tail) else ""
    seeds = [f"-{seed}"] if seed not in ("", "s1") else ["", "-s1"]
    for suffix in seeds:
        for candidate in (f"{lang}-ar-2e-3{suffix}", f"{lang}-ar{suffix}"):
            if candidate in names:
                return candidate
    return None


def table(out: Path, references: list[Path] | None = None) -> str:
    """Markdown of the runs in ``out``; All-Reduce's curves may also come from ``references``."""
    curves = {log.stem: read_curve(log) for log in sorted(out.glob("*.log"))}
    curves = {name: curve for name, curve in curves.items() if curve}
    bleus = {log.stem: read_bleu(log) for log in sorted(out.glob("*.log")) if log.stem in curves}
    known = dict(curves)
    for directory in references or []:
        known.update({log.stem: read_curve(log) for log in sorted(directory.glob("*-ar-*.log"))})
    steps = sorted({s for curve in curves.values() for s in curve})
    with_bleu = any(b is not None for b in bleus.values())
    lines = [
        "| run | " + " | ".join(f"{s}" for s in steps) + (" | BLEU |" if with_bleu else " |"),
        "|---|" + "---:|" * (len(steps) + with_bleu),
    ]
    for name, curve in curves.items():
        reference = reference_of(name, list(known))
        cells = []
        for s in steps:
            if s not in curve:
                cells.append("")
                continue
            compared = known[reference].get(s) if reference is not None and reference != name else None
            cells.append(nll_cell(curve[s], compared))
        if with_bleu:
            bleu = bleus[name]
            other = bleus.get(reference) if reference is not None and reference != name else None
            difference = "" if bleu is None or other is None else f" ({bleu - other:+.2f})"
            cells.append("" if bleu is None else f"{bleu:.2f}{difference}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--screen", choices=sorted(SCREENS), required=True)
    parser.add_argument("--data", required=True, help="the Multi30k directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--deadline", type=float, default=430.0, help="seconds before unfinished runs stop")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument(
        "--bleu", action="store_true", help="each run scores its final average on the test split"
    )
    parser.add_argument("--only", nargs="*", default=[], help="run only these of the screen's runs")
    parser.add_argument(
        "--references", type=Path, nargs="*", default=[], help="other screens' OUT (All-Reduce)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="to every run (e.g. data.cache_dir=...)"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only) - set(SCREENS[args.screen]))
    if unknown:
        parser.error(
            f"--only: {', '.join(unknown)} not in screen {args.screen!r}: {', '.join(SCREENS[args.screen])}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        processes = []
        for name, run_args in SCREENS[args.screen].items():
            if args.only and name not in args.only:
                continue
            command = [
                sys.executable, "-m", "benchmarks.parity.workers", "--data", args.data, "--workers", "4",
                "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--device", args.device,
                "--out", str(args.out / f"{name}.json"), *(["--bleu"] if args.bleu else []), *run_args,
                *args.overrides,
            ]  # fmt: skip
            log = (args.out / f"{name}.log").open("w")
            environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment))
        begin = time.monotonic()
        while time.monotonic() - begin < args.deadline and any(p.poll() is None for p in processes):
            time.sleep(5)
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            process.wait()
        print(f"{time.monotonic() - begin:.0f} s", flush=True)
    markdown = table(args.out, args.references)
    (args.out / "screen.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
