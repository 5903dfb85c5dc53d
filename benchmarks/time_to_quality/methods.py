"""What the benchmark compares: float32 DDP, what torch ships against slow networks, the seed authors'
decent-dp, and DecentralizedAdam with the library's default and with a chosen setting; the cluster's
shape; and the order the trainings run in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decentadam.options import DEFAULT_SETTING, SETTINGS

NODES, RANKS_PER_NODE = 2, 2
"""The emulated cluster: 2 nodes x 2 ranks (the translation preset's 4 ranks)."""
BASELINE = "allreduce"
DEFAULT = "decentadam-default"
BEST = "decentadam-best"
TRAIN = "recipes.translation.train"
"""The recipe's module, started with ``python -m`` from the repository root."""
ALTERNATIVES = "benchmarks.time_to_quality.alternatives"
"""The module that runs the recipe's loop with another data-parallel method."""


@dataclass(frozen=True)
class Method:
    """One training configuration of the comparison."""

    name: str
    """Name on the command line (``--methods``) and in the JSON."""
    label: str
    """Name in the report."""
    alternative: bool = False
    """Run by :mod:`benchmarks.time_to_quality.alternatives` (else by the recipe itself)."""

    @property
    def is_default(self) -> bool:
        """Whether it is ``DecentralizedAdam(params, lr)`` with nothing else: the library's default."""
        return self.name == DEFAULT


METHODS = {
    m.name: m
    for m in (
        Method(BASELINE, "DDP + AdamW (float32)"),
        Method("allreduce-bf16", "DDP + AdamW, bf16_compress_hook", alternative=True),
        Method("powersgd", "DDP + AdamW, PowerSGD rank 4", alternative=True),
        Method("postlocal", "post-local SGD (AdamW, average every 4 steps)", alternative=True),
        Method("decent-dp", "decent-dp 0.2.3 (AccumAdamW on AER)", alternative=True),
        Method(DEFAULT, "DecentralizedAdam, the library's default"),
        Method(BEST, "DecentralizedAdam, the chosen setting"),
    )
}
DEFAULT_METHODS = tuple(METHODS)
"""What ``--methods`` defaults to: every method, All-Reduce first."""


def label(name: str) -> str:
    """A method's name in the report (a name the benchmark does not know stays as it is)."""
    return METHODS[name].label if name in METHODS else name


def setting_args(name: str) -> list[str]:
    """The recipe's arguments that run DecentralizedAdam with ``SETTINGS[name]`` as it is now: the
    name and every option written out, so that the preset file's own options change nothing."""
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}: choose one of {', '.join(sorted(SETTINGS))}")
    options = {k: v for k, v in SETTINGS[name].flat().items() if v is not None}
    return [
        "--optimizer",
        "decentralized",
        f"optim.setting={name}",
        *(f"optim.{k}={v}" for k, v in options.items()),
    ]


def method_args(name: str, best: str | None, warmup: int) -> list[str]:
    """``python -m MODULE ARGS`` of one method, without the recipe's preset and overrides: the module
    and the method's own arguments (``best``: the setting of ``decentadam-best``; ``warmup``: the
    steps PowerSGD and post-local SGD start after)."""
    if name == BASELINE:
        return ["-m", TRAIN, "--optimizer", "allreduce"]
    if name == DEFAULT:
        return ["-m", TRAIN, *setting_args(DEFAULT_SETTING)]
    if name == BEST:
        if best is None:
            raise ValueError(
                f"{BEST} needs a setting's name (--best NAME, one of {', '.join(sorted(SETTINGS))})"
            )
        return ["-m", TRAIN, *setting_args(best)]
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {', '.join(METHODS)}")
    return ["-m", ALTERNATIVES, name, f"--warmup={warmup}", "--optimizer", "allreduce"]


@dataclass(frozen=True)
class Job:
    """One training of the benchmark: a method, a seed (initial weights and data order) and a rate."""

    method: str
    seed: int
    lr: float

    def key(self, grid: bool) -> str:
        """``METHOD/seedN``, or ``METHOD/lr=X/seedN`` when the rate comes from a grid."""
        return f"{self.method}/lr={self.lr:g}/seed{self.seed}" if grid else f"{self.method}/seed{self.seed}"


def run_order(methods: Sequence[str], seeds: Sequence[int], lrs: Sequence[float]) -> list[Job]:
    """Every (method, seed, rate) once, seed after seed. Each seed starts with All-Reduce (at every
    rate): the others train for its training time, so it must be known first. The other methods (and
    rates) follow in the given order for the first seed, reversed for the second, and so on: a slow
    drift of the machine then hits each of them about equally on the mean of two seeds."""
    first = [(lr, method) for lr in lrs for method in methods if method == BASELINE]
    rest = [(lr, method) for lr in lrs for method in methods if method != BASELINE]
    jobs = []
    for index, seed in enumerate(seeds):
        order = first + (rest if index % 2 == 0 else rest[::-1])
        jobs += [Job(method, seed, lr) for lr, method in order]
    return jobs


def about(name: str, best: str | None, warmup: int) -> str:
    """What ``name`` runs, for the report: its hooks, its package's version, its setting's options."""
    from benchmarks.time_to_quality import alternatives as alt

    if name in (DEFAULT, BEST):
        setting = DEFAULT_SETTING if name == DEFAULT else best
        assert setting is not None  # method_args refuses BEST without it
        options = ", ".join(f"{k}={v!r}" for k, v in SETTINGS[setting].flat().items() if v is not None)
        return f"DecentralizedAdam with setting {setting!r} as it is now ({options})"
    return {
        BASELINE: "DDP + torch AdamW: the float32 gradients all-reduced every step",
        "allreduce-bf16": "DDP + AdamW with torch's bf16_compress_hook (registered under another name: DDP "
        "checks for NCCL by the function's name, and gloo all-reduces bfloat16)",
        "powersgd": f"DDP + AdamW with torch's powerSGD_hook, rank {alt.POWERSGD_RANK}, error feedback and "
        f"warm start, plain all-reduce for the first {max(warmup, 2)} steps (the warm-up); AdamW sees the "
        "low-rank approximation of the mean gradient plus the error fed back from the step before; each "
        "bucket's compressed all-reduces finished before the next bucket's (gloo orders them per rank)",
        "postlocal": f"PostLocalSGDOptimizer(AdamW, PeriodicModelAverager(period={alt.PERIOD}, "
        f"warmup_steps={warmup})) with post_localSGD_hook (start_localSGD_iter={warmup}, the nodes as "
        "subgroups): after the warm-up the gradients are all-reduced inside each node and all ranks "
        f"average their parameters every {alt.PERIOD} steps",
        "decent-dp": f"decent_dp {_version('decent-dp')}: DecentralizedDataParallel on "
        f"{alt.DECENT_DP_TOPOLOGY} with its AccumAdamW (accum_iter={alt.DECENT_DP_WINDOW}), updates from "
        "backward hooks",
    }[name]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"
