"""What the benchmark compares: the trainings (methods), the cluster's shape, and All-Reduce as the
baseline every ratio is taken to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decentadam.runtime_model import ALLREDUCE

NODES, RANKS_PER_NODE = 2, 2
"""The emulated cluster: 2 nodes x 2 ranks (the translation preset's 4 ranks)."""
BUCKET_BYTES = 25 * 2**20
"""DDP's bucket_cap_mb and DecentralizedAdam's bucket_size_mb, both 25 MB by default."""


@dataclass(frozen=True)
class Method:
    """One training configuration of the comparison."""

    name: str
    """Name on the command line (``--methods``) and in the JSON."""
    label: str
    """Name in the report."""
    model: str
    """The runtime model's name for it."""
    args: tuple[str, ...]
    """What the recipe's ``train`` gets to run it."""
    workload: dict[str, Any] = field(default_factory=dict)
    """Fields of the runtime model's ``Workload`` that the method sets (its own options)."""
    judged: bool = False
    """Whether the report checks it against issue 21's time-to-quality goals (the methods at
    ``aer``'s inter-node bytes, and the nodes' options: the shared second moment, the synchronous
    warm-up)."""

    @property
    def bf16_updates(self) -> bool:
        """Whether it sends bfloat16 updates (``optim.exchange=bf16_updates``): the runtime model's
        ``update_values`` is then the model's parameter count, known after calibration."""
        return "optim.exchange=bf16_updates" in self.args

    @property
    def share_every(self) -> int:
        """How often its nodes share their second moment (``optim.share_second_moment_every``; 0:
        never, the recipes' default): the runtime model's ``moment_values`` is then the model's
        parameter count too, sent every ``share_every``-th step."""
        prefix = "optim.share_second_moment_every="
        return next((int(a[len(prefix) :]) for a in self.args if a.startswith(prefix)), 0)


NODES_BF16 = (
    "--optimizer",
    "decentralized",
    "optim.topology=complete",
    "optim.intra_node=all_reduce",
    "optim.second_moment=group_gradient",
    "optim.exchange=bf16_updates",
)
"""The nodes on ``complete`` with bfloat16 updates (the recipe's arguments of complete-node-bf16)."""

METHODS = {
    m.name: m
    for m in (
        Method("allreduce", "All-Reduce (DDP + AdamW)", ALLREDUCE, ("--optimizer", "allreduce")),
        Method(
            "aer", "AccumAdam-AER", "aer", ("--optimizer", "decentralized", "optim.topology=aer"), judged=True
        ),
        Method(
            "complete",
            "AccumAdam-complete",
            "complete",
            ("--optimizer", "decentralized", "optim.topology=complete"),
        ),
        Method(
            "aer-node",
            "DecentralizedAdam-AER, gradients averaged in nodes",
            "aer",
            (
                "--optimizer",
                "decentralized",
                "optim.topology=aer",
                "optim.intra_node=all_reduce",
                "optim.second_moment=group_gradient",
            ),
            {"intra_node": "all_reduce"},
            judged=True,
        ),
        Method(
            "complete-node-bf16",
            "DecentralizedAdam-complete over nodes, bf16 updates",
            "complete",
            NODES_BF16,
            {"intra_node": "all_reduce"},
            judged=True,
        ),
        Method(
            "complete-node-bf16-shared",
            "DecentralizedAdam-complete over nodes, bf16 updates, second moment shared every 2 steps",
            "complete",
            (*NODES_BF16, "optim.share_second_moment_every=2"),
            {"intra_node": "all_reduce"},
            judged=True,
        ),
        Method(
            "complete-node-bf16-shared-sync",
            "DecentralizedAdam-complete over nodes, bf16 updates, second moment shared, first 300 steps "
            "synchronous",
            "complete",  # the runtime model's step is the overlapped one (the warm-up is measured)
            (*NODES_BF16, "optim.share_second_moment_every=2", "optim.sync_steps=300"),
            {"intra_node": "all_reduce"},
            judged=True,
        ),
    )
}
BASELINE = "allreduce"
DEFAULT_METHODS = ("allreduce", "aer", "complete")
"""What ``--methods`` defaults to (the comparison of the committed report)."""


def label(name: str) -> str:
    """A method's name in the report (a name the benchmark does not know stays as it is)."""
    return METHODS[name].label if name in METHODS else name
