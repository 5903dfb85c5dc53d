"""``python -m benchmarks.time_to_quality``: see the package's docstring and ``cli``."""

import sys

if not __package__:  # run as a file: the `benchmarks` package would not be importable
    raise SystemExit("run python -m benchmarks.time_to_quality from the repository root")

from benchmarks.time_to_quality.cli import main

sys.exit(main())
