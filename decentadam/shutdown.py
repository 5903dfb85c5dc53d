"""The process's open communicators, closed at interpreter exit: the fallback for a missing ``close()``.

A script usually ends right after its last ``step()``, with exchanges in flight. A gloo rank that
exits with one still running, or whose process groups are torn down during interpreter shutdown,
can abort (see :meth:`decentadam.collectives.ProcessGroupCommunicator.close`). The explicit way out is
``optimizer.close()`` (or ``with DecentralizedAdam(...) as optimizer:``); this module remembers
every communicator that has not been closed yet and closes it from an ``atexit`` hook. It is the
only module of the package with module-level mutable state.

The registry holds communicators strongly, as ``torch.distributed`` holds their process groups:
an optimizer dropped without ``close()`` keeps its exchange groups (and, with hierarchical sums,
its scratch buffers) until exit.
"""

from __future__ import annotations

import atexit
import logging
from typing import Protocol

__all__ = ["close_all", "open_count", "register", "unregister"]

logger = logging.getLogger(__name__)


class _Closable(Protocol):
    def close(self) -> None: ...


_OPEN: dict[int, _Closable] = {}  # id -> communicator, in the order they were opened


def register(communicator: _Closable) -> None:
    """Remember ``communicator`` until it is closed (its ``close()`` calls :func:`unregister`)."""
    _OPEN[id(communicator)] = communicator


def unregister(communicator: _Closable) -> None:
    """Forget ``communicator``: it was closed."""
    _OPEN.pop(id(communicator), None)


def open_count() -> int:
    """How many communicators of this process are still open."""
    return len(_OPEN)


def close_all() -> None:
    """Close every open communicator, oldest first: wait for its exchanges, then end its threads.

    Registered with ``atexit``; call it yourself before tearing down ``torch.distributed`` when you
    cannot reach the optimizers to ``close()`` them.
    """
    for communicator in list(_OPEN.values()):
        try:
            communicator.close()
        except Exception as error:  # at exit nothing is left to save: report and go on
            logger.warning("decentadam: closing a communicator failed: %s", error)
            unregister(communicator)


atexit.register(close_all)
