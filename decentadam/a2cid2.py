"""Moved to :mod:`decentadam.asynchronous.a2cid2`; this module keeps the old import path working."""

from decentadam.asynchronous.a2cid2 import *  # noqa: F403
from decentadam.asynchronous.a2cid2 import __all__ as __all__
