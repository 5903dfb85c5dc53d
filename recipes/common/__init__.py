"""What the recipes share, once: scaffolding that a user of the library would not call.

- :mod:`recipes.common.config`: dataclass sections, TOML presets, ``key=value`` overrides.
- :mod:`recipes.common.cli`: the command line every ``train.py`` takes, and bad input as one error line.
- :mod:`recipes.common.run`: the run directory: ``step-N`` checkpoints, ``keep_last``, config and metrics.
- :mod:`recipes.common.optim`: the optimizer of a run (All-Reduce, decentralized or A2CiD2) and its
  parameter groups.
- :mod:`recipes.common.loop`: precision, the training clock, the time-based stop.
- :mod:`recipes.common.launch`: the ``accelerate launch`` command of the ``compare.py`` scripts.

Each recipe's ``train.py`` keeps its own loop, top to bottom, with the lines that differ from a plain
Accelerate loop marked ``# decentadam``: the loop is the documentation of the integration.
"""
