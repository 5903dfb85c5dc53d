"""A recipe's progress on stderr: a bar on a terminal, one plain line per log step in a file.

``train.log_format`` (``--log-format``) chooses:

``auto``   ``bar`` when stderr is a terminal, else ``text`` (the default)
``bar``    tqdm's bar on the main process; messages are written above it
``text``   one line per log step, ``step 20/100  loss 5.123  tok/s 5120  consensus 1.2e-03  eta 0:01:23``
           (no carriage returns: what a SLURM log or ``2> train.log`` should hold)
``json``   one JSON object per line: ``message`` (the text line) and the values (``step``,
           ``train/loss``, ``eta_s``, the rank for a rank's message, ...)

Every message of a run goes through the logger ``recipes`` (:data:`logger`), whose handler
:class:`Progress` installs: the log steps and evaluations of the main process, and the messages of
every rank (``rank N: first optimizer step ...``), so that none breaks the bar or the lines. A
message's values go in ``extra={"values": {...}}``; the ``json`` format writes them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import timedelta
from typing import IO, Any

from recipes.common.config import check_choice

__all__ = ["LOG_FORMATS", "Progress", "logger", "showing_bars"]

LOG_FORMATS = ("auto", "bar", "text", "json")

logger = logging.getLogger("recipes")
"""The recipes' logger: messages for the user, written by the handler of the run's :class:`Progress`."""


def resolved(log_format: str, stream: IO[str]) -> str:
    """``log_format`` with ``auto`` made ``bar`` (``stream`` is a terminal) or ``text``."""
    if log_format == "auto":
        return "bar" if stream.isatty() else "text"
    return log_format


def showing_bars(log_format: str) -> bool:
    """Whether progress bars may be drawn on stderr (data preparation's, say): ``log_format`` is
    ``bar``, or ``auto`` on a terminal."""
    return resolved(log_format, sys.stderr) == "bar"


class _Handler(logging.Handler):
    """Writes a record as its message (``text``, ``bar``: above the bar) or as a JSON line."""

    def __init__(self, stream: IO[str], log_format: str, bar: Any | None) -> None:
        super().__init__()
        self.stream, self.log_format, self.bar = stream, log_format, bar

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if self.log_format == "json":
                text = json.dumps({"message": text, **getattr(record, "values", {})})
            if self.bar is not None:
                self.bar.write(text, file=self.stream)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()
        except Exception:  # logging's contract: a failed write is reported, never raised
            self.handleError(record)


def _library_bars(show: bool) -> None:
    """Transformers' own bars (``save_pretrained``'s "Writing model shards") on or off, as ours."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a recipe without transformers draws no such bar
        return
    if show:
        hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    else:
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


class Progress:
    """The run's progress from step ``initial`` to ``total``, in ``log_format`` (:data:`LOG_FORMATS`).

    Every rank makes one; only the ``main`` one shows the bar and the log steps, every rank's
    messages go through :data:`logger`. ``close()`` removes the handler.
    """

    def __init__(
        self, log_format: str, total: int, initial: int, *, main: bool, stream: IO[str] | None = None
    ) -> None:
        check_choice("train.log_format", log_format, LOG_FORMATS)
        self.stream = sys.stderr if stream is None else stream
        log_format = resolved(log_format, self.stream)
        self.log_format, self.total, self.main = log_format, total, main
        self.bar: Any | None = None
        if log_format == "bar" and main:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, file=self.stream)
        self._first, self._since = initial, time.perf_counter()
        _library_bars(log_format == "bar")
        for old in [h for h in logger.handlers if isinstance(h, _Handler)]:  # a previous run's
            logger.removeHandler(old)
        self.handler = _Handler(self.stream, log_format, self.bar)
        logger.addHandler(self.handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # one line per message, not another through the root logger's handlers

    def update(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def eta(self, step: int) -> float:
        """Wall seconds until ``total`` at the pace since the start (evaluations and saves included)."""
        done = step - self._first
        return (time.perf_counter() - self._since) / done * (self.total - step) if done > 0 else 0.0

    def log(self, step: int, values: dict[str, Any], shown: dict[str, str]) -> None:
        """The log step ``step``: ``shown`` (name: formatted value) on the bar or a line, ``values``
        in the JSON line (main process)."""
        if not self.main:
            return
        if self.bar is not None:
            self.bar.set_postfix(shown)
            return
        eta = self.eta(step)
        parts = [f"step {step}/{self.total}", *(f"{k} {v}" for k, v in shown.items())]
        parts.append(f"eta {timedelta(seconds=round(eta))}")
        logger.info("  ".join(parts), extra={"values": {"step": step, **values, "eta_s": round(eta, 1)}})

    def write(self, message: str, **values: Any) -> None:
        """A message of the main process (an evaluation's scores), with its ``values`` for JSON."""
        if self.main:
            logger.info(message, extra={"values": values})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        logger.removeHandler(self.handler)
        logger.propagate = True
