"""Quickstart: All-Reduce against DecentralizedAdam's default, a small translation task, 4 CPU processes.

::

    python -m recipes.translation.demo            # `make demo`; about 5 minutes on 2 cores

1. writes a synthetic English->German corpus (``synthetic.py``: 20,000 training pairs generated
   from the project's own small grammar and lexicon; no download, no third-party text) to
   ``OUT/data``;
2. trains the same tiny Transformer (preset ``demo-synthetic-en-de``) twice with ``accelerate
   launch`` on 4 CPU processes emulating 2 nodes x 2: once with All-Reduce (DDP + AdamW), once
   with ``decentadam``'s ``DecentralizedAdam`` with its default setting (the ranks of a node
   average their gradients; the 2 nodes average bfloat16 updates, overlapped with the next
   step), the same number of steps on the same data;
3. translates the test set with beam search (``python -m eval.bleu``) and prints both sacreBLEU
   scores with the signature, and writes ``OUT/report.json`` and ``OUT/report.png`` (``compare.py``).

Four processes share two cores here, so the timings show this machine's overheads, not the speed-up
on a cluster.
"""

from __future__ import annotations

if not __package__:  # run as a file, `recipes` would not be importable
    raise SystemExit(
        f"{__file__} is a module of the recipes package: "
        "run python -m recipes.translation.demo from the repository root"
    )

import argparse
import shutil
import time
from pathlib import Path

from recipes.translation import synthetic
from recipes.translation.compare import compare, summary


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.translation.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/translation-demo", help="data, runs and report (replaced)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of each run")
    parser.add_argument("--processes", type=int, default=4, help="CPU processes per run")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for both runs")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    begin = time.perf_counter()
    data = synthetic.write(out / "data")
    print(f"synthetic English->German corpus (20,000 / 500 / 500 pairs) in {data}")
    report = compare(
        "demo-synthetic-en-de",
        str(data),
        args.steps,
        out,
        processes=args.processes,
        overrides=[f"data.cache_dir={out / 'cache'}", *args.overrides],
    )
    print(summary(report))
    print(f"{time.perf_counter() - begin:.0f} s in all; report: {out / 'report.json'}, {out / 'report.png'}")


if __name__ == "__main__":
    main()
