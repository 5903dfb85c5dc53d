"""``python -m decentadam.runtime_model``: see :mod:`decentadam.runtime_model.cli`."""

import sys

from decentadam.runtime_model.cli import main

sys.exit(main())
