"""Moved to :mod:`decentadam.asynchronous.graph`; this module keeps the old import path working."""

from decentadam.asynchronous.graph import *  # noqa: F403
from decentadam.asynchronous.graph import __all__ as __all__
