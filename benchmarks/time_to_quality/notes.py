"""The report's generated notes. Each states a conclusion only after checking the condition behind
it on the run's numbers (thresholds in benchmarks.thresholds), and says which one it found in its
``kind``, so that tests check the choice and the numbers rather than the wording."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.thresholds import GOSSIP_SHARE, MODEL_MISSED, WAIT_SHARE
from benchmarks.time_to_quality.methods import BASELINE, label


@dataclass(frozen=True)
class Note:
    """One generated note: which conclusion the numbers chose, and its text."""

    kind: str
    text: str


def dominant_term(run: dict[str, Any], compute_ms: float) -> str:
    """Which term the runtime model says sets this method's iteration: compute or communication."""
    predicted = run.get("predicted")
    if not predicted:
        return "-"
    comm = predicted["comm_ms"]
    if comm > compute_ms:
        return f"communication ({comm:.0f} ms > C)"
    return f"compute (C; communication {comm:.0f} ms)"


def baseline_note(report: dict[str, Any]) -> list[Note]:
    """Where All-Reduce's run came from when it was not trained in this run (``--baseline``)."""
    base = report["runs"].get(BASELINE) or {}
    if not base.get("from"):
        return []
    text = (
        f"All-Reduce was not trained in this run: its run ({base['steps']} steps, same preset, overrides "
        f"and link rate) is the one in `{base['from']}`, made by `{base['command']}`; its time is "
        "compared with this run's."
    )
    return [Note("baseline", text)]


def overlap_missed(run: dict[str, Any], compute_ms: float) -> bool:
    """Whether the model, which hides this method's exchange under the next step's compute, predicts
    the iteration more than MODEL_MISSED too fast while its ranks waited for exchanges for more than
    WAIT_SHARE of C per step: then the overlap is the term the model misses."""
    predicted, wait = run.get("predicted"), run.get("comm_wait_ms")
    if not predicted or wait is None or run.get("ms_per_iter") is None:
        return False
    too_fast: bool = predicted["iteration_ms"] < (1 - MODEL_MISSED) * run["ms_per_iter"]
    hidden: bool = predicted["comm_ms"] <= compute_ms
    return too_fast and hidden and wait > WAIT_SHARE * compute_ms


def model_notes(runs: dict[str, dict[str, Any]], compute_ms: float) -> list[Note]:
    """Per method, what the runtime model says sets its iteration, next to the measurement, and what
    its ranks' waiting for exchanges says about the model's overlap."""
    notes = []
    for name, run in runs.items():
        predicted = run.get("predicted")
        if not predicted or run.get("ms_per_iter") is None:
            continue
        error = predicted["iteration_ms"] / run["ms_per_iter"] - 1
        text = (
            f"{label(name)}: measured {run['ms_per_iter']:.0f} ms per iteration; the model predicts "
            f"{predicted['iteration_ms']:.0f} ms ({error:+.0%}), bound by {dominant_term(run, compute_ms)} "
            f"with C = {compute_ms:.0f} ms; with free optimizer steps {predicted['lower_bound_ms']:.0f} ms, "
            f"with updates and exchanges taking turns {predicted['serial_ms']:.0f} ms."
        )
        wait = run.get("comm_wait_ms")
        if wait is not None:
            text += f" Its ranks blocked {wait:.0f} ms per step waiting for exchanges"
            text += " (decentadam/comm_wait_ms)"
        if overlap_missed(run, compute_ms):
            text += (
                f", more than {WAIT_SHARE:.0%} of C, while the model, {-error:.0%} fast, has the exchange "
                "hidden under the next step's compute: the overlap is the term it misses (this run does "
                "not tell whether the exchange's own CPU work on the shared cores or a partner's slower "
                "step is what the ranks wait for)."
            )
            notes.append(Note("model, overlap missed", text))
        else:
            notes.append(Note("model", text + ("." if wait is not None else "")))
    return notes


def miss_notes(report: dict[str, Any], compute_ms: float) -> list[Note]:
    """When AER does not reach the target: how far it got, whether it was faster per iteration, what
    the gossip's share of its distance is (:func:`topology_gap`), and the two factors of its time
    ratio at the last of All-Reduce's losses it did reach (steps, which the optimizer sets; time per
    step, which the network sets)."""
    runs = report["runs"]
    aer, base = runs.get("aer"), runs.get(BASELINE)
    if aer is None or base is None or aer.get("time_to_target_s") is not None or not aer["curve"]:
        return []
    iter_ratio = aer.get("iter_ratio")
    faster = iter_ratio is not None and iter_ratio < 1
    text = (
        f"AccumAdam-AER did not reach All-Reduce's final validation loss "
        f"({report['target_valid_nll']:.3f}) in {aer.get('steps', report['steps'])} steps: it ended at "
        f"{aer['final_valid_nll']:.3f}. Its iteration took "
        f"{'-' if iter_ratio is None else f'{iter_ratio:.2f}'} x All-Reduce's (the model: All-Reduce bound "
        f"by {dominant_term(base, compute_ms)}, AER by {dominant_term(aer, compute_ms)})"
    )
    if faster:
        text += "; what it lacks is progress per optimizer step, not network time."
        notes = [Note("missed, faster per iteration", text)]
    else:
        notes = [Note("missed, not faster per iteration", text + "; it was not faster per iteration either.")]
    gap = topology_gap(runs)
    if gap is not None:
        notes.append(topology_note(gap))
    reached = [row for row in report.get("levels", []) if row["methods"]["aer"]["seconds"] is not None]
    if reached:
        last = reached[-1]
        m = last["methods"]["aer"]
        notes.append(
            Note(
                "last level reached",
                f"The last of All-Reduce's evaluated losses AER reached: {last['valid_nll']:.3f} (its step "
                f"{last['step']:.0f}), after {m['steps']:.0f} steps = {m['steps_ratio']:.2f} x as many, "
                f"in {m['time_ratio']:.2f} x the time = {m['steps_ratio']:.2f} (steps) x "
                f"{m['time_ratio'] / m['steps_ratio']:.2f} (time per step).",
            )
        )
    return notes


@dataclass(frozen=True)
class TopologyGap:
    """AER against AccumAdam on the complete graph (every rank gets the exact average every step, the
    same local steps) and All-Reduce, at the evaluations all three made (validation NLL)."""

    steps: tuple[float, ...]
    gossip: tuple[float, ...]
    """AER - complete at each step: what partial mixing costs (negative: AER is ahead)."""
    behind: tuple[float, ...]
    """AER - All-Reduce at each step: AER's distance to All-Reduce."""
    complete_behind: tuple[float, ...]
    """complete - All-Reduce at each step: what the exact average leaves of that distance."""

    @property
    def share(self) -> float | None:
        """The gossip's share of AER's distance to All-Reduce, summed over the steps where AER is
        behind All-Reduce; None when it is behind at none."""
        pairs = [(g, b) for g, b in zip(self.gossip, self.behind, strict=True) if b > 0]
        if not pairs:
            return None
        return sum(g for g, _ in pairs) / sum(b for _, b in pairs)

    @property
    def is_gossips(self) -> bool:
        """Whether the gossip's share of the distance exceeds GOSSIP_SHARE."""
        return self.share is not None and self.share > GOSSIP_SHARE


def topology_gap(runs: dict[str, dict[str, Any]]) -> TopologyGap | None:
    """AER, AccumAdam-complete and All-Reduce at their common evaluations (None without the three
    runs or a common evaluation)."""
    names = ("aer", "complete", BASELINE)
    if not all(name in runs for name in names):
        return None
    aer, complete, base = ({p["step"]: p["valid_nll"] for p in runs[name]["curve"]} for name in names)
    steps = sorted(set(aer) & set(complete) & set(base))
    if not steps:
        return None
    return TopologyGap(
        steps=tuple(steps),
        gossip=tuple(aer[t] - complete[t] for t in steps),
        behind=tuple(aer[t] - base[t] for t in steps),
        complete_behind=tuple(complete[t] - base[t] for t in steps),
    )


def topology_note(gap: TopologyGap) -> Note:
    """Whether AER's distance to All-Reduce is the gossip's (partial mixing) or in what AccumAdam on
    the complete graph also does, as :attr:`TopologyGap.is_gossips` decides."""
    between = max(abs(g) for g in gap.gossip)
    share = "-" if gap.share is None else f"{gap.share:.0%}"
    rest = f"{min(gap.complete_behind):.2f} to {max(gap.complete_behind):.2f}"
    measured = (
        f"AccumAdam-complete (the exact average of all replicas every step, the same local steps) and "
        f"AER differ by at most {between:.3f} in validation loss at equal steps; AER's excess over it is "
        f"{share} of AER's distance to All-Reduce (summed over the evaluations where AER is behind), and "
        f"All-Reduce is {rest} below AccumAdam-complete"
    )
    if gap.is_gossips:
        return Note(
            "gossip",
            measured + f". More than {GOSSIP_SHARE:.0%}: a part of AER's distance is the gossip's (partial "
            "mixing), the rest is in what AccumAdam-complete also does differently from All-Reduce.",
        )
    if gap.share is None:
        return Note("not behind", measured + ": AER is not behind All-Reduce at any common evaluation.")
    return Note(
        "not the gossip's",
        measured + f". At most {GOSSIP_SHARE:.0%}: the distance is not the gossip's but in what both "
        "AccumAdam runs do differently from All-Reduce: the Adam step on each rank's own gradient before "
        "the average, and their beta2 and accumulation window, which this run does not separate.",
    )
