"""The translation recipe with ``second_moment="group_gradient"``: remedy c's probe, now a library option.

The group-gradient second moment (docs/parity.md, section 6) is
``DecentralizedAdam(second_moment="group_gradient", v_every=k)``, whose docstring has the math. This
entry point stays so that the probe's commands run as they did: it adds
``optim.second_moment=group_gradient optim.v_every=K`` (``K`` from ``DECENTADAM_V_EVERY``, default
2) before the command line's own overrides, and with ``DECENTADAM_MIX_WEIGHT`` set it runs
:mod:`benchmarks.parity.lazy_mixing` with them. The same run without it::

    accelerate launch --multi_gpu --num_processes 4 -m recipes.translation.train \\
        --preset multi30k-en-de --optimizer decentralized data=MULTI30K train.max_steps=400 \\
        optim.second_moment=group_gradient optim.v_every=2
"""

from __future__ import annotations

import os
import sys

from benchmarks.parity.recipe import run_recipe


def main() -> None:
    every = os.environ.get("DECENTADAM_V_EVERY", "2")
    sys.argv[1:1] = ["optim.second_moment=group_gradient", f"optim.v_every={every}"]  # given ones win
    if "DECENTADAM_MIX_WEIGHT" in os.environ:  # with lazy mixing as well
        from benchmarks.parity import lazy_mixing

        lazy_mixing.main()
        return
    run_recipe()


if __name__ == "__main__":
    main()
