"""Chaos: kill and stall ranks of a recipe run under ``torchrun --max-restarts``; it must end on its own,
bitwise equal to the same run without faults, and never leave an unloadable checkpoint.

Run from the repository root (on a shared machine, under its CPU lock)::

    OMP_NUM_THREADS=1 flock /tmp/decentadam-cpu.lock .venv/bin/python -m benchmarks.chaos
    .venv/bin/python -m benchmarks.chaos --processes 2 --faults kill-in-save,stop --out /tmp/chaos

The run is the translation recipe's ``demo-synthetic-en-de`` preset on the synthetic corpus of
``recipes/translation/synthetic.py`` with a tiny model (:data:`TINY`), ``--processes`` gloo ranks
under ``torchrun --max-restarts``, decentralized AccumAdam, a checkpoint every ``--save-every`` steps
and ``--resume auto``. First the same run without faults (the reference), then the chaos run, in which
a controller injects ``--faults`` one after the other, each at a random rank (``--seed``):

- ``kill``: SIGKILL at a random moment once the current attempt has written a checkpoint;
- ``kill-in-save``: SIGKILL while a checkpoint is half written: the recipe's save pauses
  ``--save-delay-s`` after staging the weights (``RECIPES_CHAOS_SAVE_DELAY_S``, read by
  :meth:`recipes.common.run.RunDirectory.saving`, this benchmark's only hook), and the controller
  strikes when the staging directory appears;
- ``stop``: SIGSTOP at a random moment, held until another rank has given up after
  ``train.timeout_s`` (``--timeout-s``) and exited, then SIGCONT: the stalled rank must fail the
  job, not hang it.

Each fault fails the job and torchrun restarts every rank, which continues from the newest complete
checkpoint. After every fault (the ranks are gone, the restart not yet saving) every complete
checkpoint is loaded with decentadam's loader (``read_meta``, every rank's ``load_rank_state``, the
consensus weights): none may be unloadable. The run passes when torchrun exits 0 at ``max_steps``,
its final consensus model (``step-MAX/model.safetensors``) is bitwise equal to the reference's, and
every checkpoint loaded. ``train.keep_last=0`` keeps every checkpoint, so that loading them never
races with the restart's pruning.

Writes ``benchmarks/results/chaos.{json,md}`` (``--out`` to change): the faults (kind, rank, time,
during a save or not, the step reached and the step resumed from), the restarts, the steps redone,
the wall time against the fault-free run, and the command.
"""

from __future__ import annotations

if not __package__:  # run as a file: the `benchmarks` package would not be importable
    raise SystemExit(
        f"{__file__} is a module of the benchmarks package: run python -m benchmarks.chaos "
        "from the repository root"
    )

import argparse
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.machine import machine
from decentadam import checkpoint_files
from recipes.common.launch import environment, torchrun
from recipes.common.run import SAVE_DELAY_ENV, list_checkpoints, step_name

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("kill", "kill-in-save", "stop")
TINY = (
    "data.vocab_size=200", "model.layers=1", "model.d_model=32", "model.ffn_dim=64", "model.heads=2",
    "train.global_tokens=1024", "train.log_every=1", "train.eval_every=1", "train.keep_last=0",
    "data.val_limit=40", "--optimizer", "decentralized",
)  # fmt: skip
"""The recipe's settings besides steps, saves and paths; ``eval_every=1`` puts every step in
``metrics.jsonl``, which is how the controller knows the step a fault interrupted."""


class ChaosError(RuntimeError):
    """The run broke a rule of the benchmark (it hung, failed, or left an unloadable checkpoint)."""


@dataclass
class Fault:
    kind: str
    rank: int
    at_s: float  # since the chaos run started
    during_save: bool  # a checkpoint's staging directory existed and its step was not complete
    step_reached: int  # the last step the interrupted attempt recorded
    stalled_s: float = 0.0  # stop: how long the rank was held
    resumed_from: int | None = None  # the step the restart continued from (0: a new start)
    checked: list[str] = field(default_factory=list)  # the complete checkpoints loaded after it

    @property
    def redone(self) -> int:
        return self.step_reached - (self.resumed_from or 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=4, help="ranks (gloo, this machine)")
    parser.add_argument("--steps", type=int, default=60, help="train.max_steps")
    parser.add_argument("--save-every", type=int, default=5, help="train.save_every")
    parser.add_argument(
        "--faults",
        default="kill-in-save,stop,kill,kill-in-save,stop,kill",
        help=f"comma-separated, in order, of {', '.join(KINDS)}",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=8.0, help="train.timeout_s: a stalled rank's grace"
    )
    parser.add_argument("--save-delay-s", type=float, default=1.5, help="the pause inside every save")
    parser.add_argument("--seed", type=int, default=0, help="which rank, and when")
    parser.add_argument("--deadline-s", type=float, default=900.0, help="give up on a run after this long")
    parser.add_argument("--work", type=Path, help="run directories (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos", help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    args.faults = [kind for kind in args.faults.split(",") if kind]
    unknown = sorted(set(args.faults) - set(KINDS))
    if unknown:
        parser.error(f"--faults: unknown {', '.join(unknown)}; expected of {', '.join(KINDS)}")
    return args


def command(args: argparse.Namespace, corpus: Path, output: Path, *, max_restarts: int) -> list[str]:
    """The torchrun command of one run (the reference: ``max_restarts=0``)."""
    return [
        *torchrun("recipes.translation.train", args.processes, max_restarts=max_restarts),
        "--preset", "demo-synthetic-en-de", "--resume", "auto", f"data={corpus}",
        f"data.cache_dir={corpus.parent / 'cache'}", f"train.output_dir={output}", *TINY,
        f"train.max_steps={args.steps}", f"train.save_every={args.save_every}",
        f"train.timeout_s={args.timeout_s}",
    ]  # fmt: skip


# ------------------------------------------------------------------------- the processes of a run


def workers(agent: int) -> dict[int, int]:
    """Rank -> process id of torchrun's live workers (its children with a RANK)."""
    found = {}
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile
        ranks = [entry[5:] for entry in environ if entry.startswith(b"RANK=")]
        if ranks and state != "Z":
            found[int(ranks[0])] = int(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait(condition: Callable[[], Any], what: str, deadline: float, process: subprocess.Popen[bytes]) -> Any:
    """Poll ``condition`` every 20 ms until it is truthy; raise if torchrun ends or time runs out."""
    while True:
        value = condition()
        if value:
            return value
        if process.poll() is not None:
            raise ChaosError(f"torchrun exited ({process.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise ChaosError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ------------------------------------------------------------------------- what is on disk


def load_all(run: Path) -> list[str]:
    """Load every complete checkpoint in ``run`` with decentadam's loader; their names. Raises
    ChaosError naming one that does not load."""
    from safetensors.torch import load_file

    names = []
    for path in list_checkpoints(run):
        try:
            meta = checkpoint_files.read_meta(path)
            for rank in range(int(meta["world_size"])):
                checkpoint_files.load_rank_state(path, rank)
            load_file(path / checkpoint_files.WEIGHTS_NAME)
        except Exception as error:
            raise ChaosError(f"{path} counts as complete but does not load: {error!r}") from error
        names.append(path.name)
    return names


def fresh_staging(run: Path, since: float) -> Path | None:
    """A checkpoint's staging directory created after ``since`` (``time.time()``), its step not
    complete: a save in progress now (a killed save's leftover is older)."""
    for staging in run.glob(".step-*.incomplete"):
        final = run / staging.name[1 : -len(".incomplete")]
        try:
            if staging.stat().st_ctime > since and not checkpoint_files.is_checkpoint(final):
                return staging
        except OSError:
            continue  # renamed into place meanwhile
    return None


def newest_step(run: Path) -> int:
    found = list_checkpoints(run)
    return int(found[-1].name.split("-")[1]) if found else 0


def last_recorded_step(run: Path) -> int:
    """The last step in ``metrics.jsonl`` (every step is recorded: ``eval_every=1``)."""
    file = run / "metrics.jsonl"
    lines = file.read_text().splitlines() if file.is_file() else []
    return max((int(json.loads(line)["step"]) for line in lines if line.strip()), default=0)


# ------------------------------------------------------------------------- the two runs


def reference(args: argparse.Namespace, corpus: Path, output: Path) -> float:
    """The run without faults; its wall seconds."""
    argv = command(args, corpus, output, max_restarts=0)
    begin = time.monotonic()
    with open(output.parent / "reference.log", "wb") as log:
        code = subprocess.run(
            argv, stdout=log, stderr=subprocess.STDOUT, env=environment(), timeout=args.deadline_s
        )
    if code.returncode != 0:
        tail = (output.parent / "reference.log").read_text(errors="replace")[-3000:]
        raise ChaosError(f"the fault-free run failed ({code.returncode}):\n{tail}")
    return time.monotonic() - begin


def inject(
    kind: str, rank: int, delay: float, process: subprocess.Popen[bytes], previous: set[int],
    args: argparse.Namespace, output: Path, begin: float, deadline: float,
) -> tuple[Fault, set[int]]:  # fmt: skip
    """One fault at ``rank`` of the next attempt (whose workers are not ``previous``), once it is
    saving (``kill-in-save``) or ``delay`` seconds after its first checkpoint; returns when every
    rank of the attempt is gone, with the fault and the attempt's workers."""

    def new_attempt() -> dict[int, int] | None:
        found = workers(process.pid)
        fresh = len(found) == args.processes and not set(found.values()) & previous
        return found if fresh else None

    ranks: dict[int, int] = wait(new_attempt, "the workers of a new attempt", deadline, process)
    started, start_step = time.time(), newest_step(output)
    if kind == "kill-in-save":
        wait(lambda: fresh_staging(output, started), "a checkpoint save", deadline, process)
    else:  # a random moment once this attempt has made progress (written a checkpoint)
        wait(lambda: newest_step(output) > start_step, "a new checkpoint", deadline, process)
        time.sleep(delay)
    during_save = fresh_staging(output, started) is not None
    at = time.monotonic() - begin
    stalled = 0.0
    if kind == "stop":
        os.kill(ranks[rank], signal.SIGSTOP)
        others = [pid for r, pid in ranks.items() if r != rank]
        wait(lambda: not all(alive(pid) for pid in others), "another rank to give up", deadline, process)
        stalled = time.monotonic() - begin - at
        os.kill(ranks[rank], signal.SIGCONT)
    else:
        os.kill(ranks[rank], signal.SIGKILL)
    wait(lambda: not any(alive(pid) for pid in ranks.values()), "the attempt to end", deadline, process)
    reached = last_recorded_step(output)
    fault = Fault(kind, rank, round(at, 2), during_save, reached, round(stalled, 2), checked=load_all(output))
    return fault, set(ranks.values())


def chaos(args: argparse.Namespace, corpus: Path, output: Path) -> tuple[list[Fault], float, int, str]:
    """The run with faults: the faults, its wall seconds, the restarts (attempts after the first) and
    its log."""
    rng = random.Random(args.seed)
    argv = command(args, corpus, output, max_restarts=len(args.faults))
    env = {**environment(), SAVE_DELAY_ENV: str(args.save_delay_s)}
    log_path = output.parent / "chaos.log"
    faults: list[Fault] = []
    begin = time.monotonic()
    deadline = begin + args.deadline_s
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            previous: set[int] = set()
            for kind in args.faults:
                rank, delay = rng.randrange(args.processes), rng.uniform(0.0, 2.0)
                fault, previous = inject(kind, rank, delay, process, previous, args, output, begin, deadline)
                faults.append(fault)
                when = f"{fault.at_s:.1f} s, step {fault.step_reached}"
                print(f"  fault {len(faults)}: {kind}, rank {rank}, {when}", flush=True)
            code = process.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except BaseException:
            for pid in workers(process.pid).values():  # each in a session of its own
                os.kill(pid, signal.SIGKILL)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    wall = time.monotonic() - begin
    text = log_path.read_text(errors="replace")
    if code != 0:
        raise ChaosError(f"the chaos run failed ({code}); the end of {log_path}:\n{text[-3000:]}")
    resumed = [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", text)]
    starts = len(re.findall(r"training pairs, ", text))  # every attempt prints it once
    restarts = starts - 1
    # the restarts that found no checkpoint started anew: the resumes are the last len(resumed) starts
    origins = [0] * (starts - 1 - len(resumed)) + resumed
    for fault, origin in zip(faults, origins, strict=False):
        fault.resumed_from = origin
    return faults, wall, restarts, text


def bitwise_equal(ours: Path, reference_run: Path) -> bool:
    from safetensors.torch import load_file

    mine, theirs = (load_file(path / checkpoint_files.WEIGHTS_NAME) for path in (ours, reference_run))
    return mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Both runs and the verdict (``passed``) with the figures of the report."""
    from recipes.translation import synthetic

    corpus = synthetic.write(work / "corpus", train=600, val=40, test=12)
    reference_wall = reference(args, corpus, work / "reference")
    faults, wall, restarts, _ = chaos(args, corpus, work / "chaos")
    final = step_name(args.steps)
    equal = bitwise_equal(work / "chaos" / final, work / "reference" / final)
    checked = load_all(work / "chaos")
    problems = []
    if not equal:
        problems.append(f"{final}'s consensus model differs from the fault-free run's")
    if restarts != len(faults):
        problems.append(f"{len(faults)} faults but {restarts} restarts")
    if final not in checked:
        problems.append(f"{final} is missing")
    return {
        "passed": not problems,
        "problems": problems,
        "faults": [{**asdict(fault), "redone": fault.redone} for fault in faults],
        "restarts": restarts,
        "steps_redone": sum(fault.redone for fault in faults),
        "bitwise_equal": equal,
        "checkpoints_loaded_at_end": checked,
        "wall_s": round(wall, 1),
        "reference_wall_s": round(reference_wall, 1),
        "overhead_s": round(wall - reference_wall, 1),
        "command": shlex.join(command(args, work / "corpus", work / "chaos", max_restarts=len(faults))),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
    }


def report(result: dict[str, Any], invocation: str) -> str:
    host = machine()
    verdict = "passed" if result["passed"] else "FAILED: " + "; ".join(result["problems"])
    lines = [
        "# Chaos: faults under torchrun --max-restarts, resumed with --resume auto",
        "",
        f"Written by `{invocation}` on {host['cpu']} ({host['cores']} cores, load {host['load']}), torch "
        f"{host['torch']}, {host['date']}.",
        "",
        f"**{verdict}**: the job ended on its own at step {result['settings']['steps']}; final consensus "
        f"model bitwise equal to the fault-free run's: "
        f"{'yes' if result['bitwise_equal'] else 'no'}; every complete checkpoint loaded after every "
        "fault and at the end.",
        "",
        "| # | fault | rank | at (s) | during a save | step reached | resumed from | steps redone "
        "| held (s) | checkpoints loaded after it |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, f in enumerate(result["faults"], 1):
        held = f"{f['stalled_s']:.1f}" if f["kind"] == "stop" else ""
        lines.append(
            f"| {i} | {f['kind']} | {f['rank']} | {f['at_s']:.1f} | {'yes' if f['during_save'] else 'no'} | "
            f"{f['step_reached']} | {f['resumed_from']} | {f['redone']} | {held} | {len(f['checked'])} |"
        )
    lines += [
        "",
        f"- restarts: {result['restarts']}; steps redone: {result['steps_redone']}",
        f"- wall: {result['wall_s']:.1f} s with faults, {result['reference_wall_s']:.1f} s without "
        f"(overhead {result['overhead_s']:.1f} s, which includes the pause of "
        f"{result['settings']['save_delay_s']} s the chaos run makes in each of its saves)",
        f"- complete checkpoints at the end: {len(result['checkpoints_loaded_at_end'])}, all loaded",
        "",
        "The chaos run's command (the fault-free run is the same with `--max-restarts 0`; the controller "
        f"sets `{SAVE_DELAY_ENV}={result['settings']['save_delay_s']}` for the chaos run only):",
        "",
        "```bash",
        result["command"],
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chaos-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, work)
    invocation = "python -m benchmarks.chaos " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result, invocation)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
