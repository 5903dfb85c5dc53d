"""Moved to :mod:`decentadam.asynchronous.pairing`; this module keeps the old import path working."""

from decentadam.asynchronous.pairing import *  # noqa: F403
from decentadam.asynchronous.pairing import __all__ as __all__
