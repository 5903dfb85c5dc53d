"""The contract of the ``eval`` scripts: the result, where it goes, and the exit codes.

``evaluate(...) -> dict`` computes the result; :func:`main` is the command line around it: the dict
as JSON on stdout, also written to ``--output`` (its folder created) when given, and

====  =======================================================================================
code  meaning
====  =======================================================================================
0     scored: the JSON is on stdout (and in ``--output``)
1     an unexpected failure (a bug, or the machine): Python's traceback on stderr
2     bad command line (argparse's usage message, or one line for options that do not go together)
3     the data: a missing or unreadable split or file, misaligned parallel files, no examples
4     the checkpoint: nothing ``from_pretrained`` loads there, or no checkpoint in a run
      (``--average-last``)
5     data and checkpoint do not fit together (classes that match none of the model's labels)
6     ``--output`` cannot be written
====  =======================================================================================

Codes 3 to 6 print one line, ``error: MESSAGE`` naming the path and what was expected, on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CheckpointError", "DataError", "EvalError", "MismatchError", "OutputError", "UsageError", "main"]


class EvalError(Exception):
    """Input that cannot be scored; the subclass says which kind, ``exit_code`` its exit code."""

    exit_code = 1


class UsageError(EvalError):
    exit_code = 2


class DataError(EvalError):
    exit_code = 3


class CheckpointError(EvalError):
    exit_code = 4


class MismatchError(EvalError):
    exit_code = 5


class OutputError(EvalError):
    exit_code = 6


def main(
    parser: argparse.ArgumentParser,
    evaluate: Callable[[argparse.Namespace], dict[str, Any]],
    argv: list[str] | None = None,
    *,
    summary: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, Any]:
    """Parse ``argv`` (``parser`` has ``--output``), evaluate, print the JSON, write ``--output``.

    ``summary`` of the result, if given, goes to stderr for people reading the log. Returns the
    result; an :class:`EvalError` exits with its code and message.
    """
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        output = _writable(args.output)
        result = evaluate(args)
        text = json.dumps(result, indent=1)
        if output is not None:
            try:
                output.write_text(text + "\n")
            except OSError as error:
                raise OutputError(f"--output {output}: cannot write it ({error})") from None
    except EvalError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    if summary is not None:
        print(summary(result), file=sys.stderr)
    print(text)
    return result


def _writable(output: str | Path | None) -> Path | None:
    """``--output`` as a path whose folder exists (created), checked before the work starts."""
    if output is None:
        return None
    path = Path(output)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"--output {path}: cannot create its folder ({error})") from None
    if path.is_dir():
        raise OutputError(f"--output {path} is a folder: give a file name, e.g. {path / 'scores.json'}")
    return path
