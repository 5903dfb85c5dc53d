"""Scores of checkpoints, one module per task: ``eval.bleu`` (translation), ``eval.accuracy`` (images).

Both follow one contract (:mod:`eval.contract`): an ``evaluate(...)`` function that returns the
result as a dict, and a command line, run as a module (or, installed, as ``decentadam-bleu`` and
``decentadam-accuracy``)::

    python -m eval.bleu CHECKPOINT --data DIR --split test --src en --tgt de [--output scores.json]
    python -m eval.accuracy CHECKPOINT --data DIR --split val [--output scores.json]

that prints that dict as JSON on stdout (and nothing else there: progress and sacreBLEU's lines go
to stderr), writes it to ``--output`` when given, and ends with one exit code per kind of error.

The name: ``eval`` is a package of this repository, installed beside ``decentadam``, and the
standard library has no module of that name (the builtin ``eval`` is a function, not a module), so
``python -m eval.bleu`` and ``from eval import bleu`` are unambiguous. Import it ``from eval import
...``: ``import eval.bleu`` would bind the name ``eval`` in the importing module over the builtin.
"""
