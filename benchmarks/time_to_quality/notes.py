"""The report's goals for the library's default and its generated notes. Each note states a conclusion
only after checking the condition behind it on the run's numbers (thresholds in
benchmarks.thresholds), and says which one it found in its ``kind``, so that tests check the choice
and the numbers rather than the wording."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.thresholds import TTQ_BLEU_GAP, TTQ_DEFAULT_RATIO
from benchmarks.time_to_quality.methods import BASELINE, DEFAULT, METHODS, label


@dataclass(frozen=True)
class Note:
    """One generated note: which conclusion the numbers chose, and its text."""

    kind: str
    text: str


def _mean(summary: dict[str, Any], field: str) -> float | None:
    value: float | None = summary[field]["mean"]
    return value


def goals(methods: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The library's default against float32 DDP and against each alternative a user has (on the
    mean of the seeds); empty without both runs."""
    ours, base = methods.get(DEFAULT), methods.get(BASELINE)
    if ours is None or base is None:
        return []
    time_ratio = _mean(ours, "time_ratio")
    found = [
        {
            "goal": f"the default reaches DDP's final validation loss in <= {TTQ_DEFAULT_RATIO:g}x "
            "DDP's time (mean of the seeds)",
            "measured": "not reached" if time_ratio is None else f"{time_ratio:.2f}x",
            "met": time_ratio is not None and time_ratio <= TTQ_DEFAULT_RATIO,
        }
    ]
    mine = _mean(ours, "time_to_target_s")
    for name, other in methods.items():
        if not METHODS.get(name, METHODS[BASELINE]).alternative:
            continue
        theirs = _mean(other, "time_to_target_s")
        failed = other.get("failed_seeds") or ours.get("failed_seeds")
        met = not failed and mine is not None and (theirs is None or mine < theirs)
        measured = f"{_seconds(mine)} vs {_seconds(theirs)}"
        found.append(
            {
                "goal": f"the default reaches it sooner than {label(name)}",
                "measured": measured + (" (a training failed)" if failed else ""),
                "met": met,
            }
        )
    bleu, base_bleu = _mean(ours, "bleu_in_allreduce_time"), _mean(base, "bleu")
    if bleu is not None and base_bleu is not None:
        found.append(
            {
                "goal": f"the default's BLEU within {TTQ_BLEU_GAP:g} of DDP's, in no more training time",
                "measured": f"{bleu:.2f} vs {base_bleu:.2f} ({bleu - base_bleu:+.2f})",
                "met": base_bleu - bleu <= TTQ_BLEU_GAP,
            }
        )
    return found


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.0f} s"


def slower_notes(methods: dict[str, dict[str, Any]]) -> list[Note]:
    """For each method the default is not sooner than: by how much, and whether it is the steps (the
    optimizer) or the time per step (the network and the method's own work) that costs it."""
    ours = methods.get(DEFAULT)
    if ours is None:
        return []
    mine = _mean(ours, "time_to_target_s")
    notes = []
    for name, other in methods.items():
        if name == DEFAULT:
            continue
        theirs = _mean(other, "time_to_target_s")
        if theirs is None or (mine is not None and mine < theirs):
            continue
        if mine is None:
            final, target = _mean(ours, "final_valid_nll"), _mean(methods[BASELINE], "final_valid_nll")
            notes.append(
                Note(
                    "not reached",
                    f"The default did not reach DDP's final validation loss on the mean of the seeds (it "
                    f"ended at {_fmt(final, '.3f')} against {_fmt(target, '.3f')}); {label(name)} reached it "
                    f"in {theirs:.0f} s.",
                )
            )
            continue
        steps = (_mean(ours, "steps_ratio"), _mean(other, "steps_ratio"))
        per_step = (_mean(ours, "per_step_ratio"), _mean(other, "per_step_ratio"))
        more_steps = None not in steps and steps[0] > steps[1]  # type: ignore[operator]
        slower_steps = None not in per_step and per_step[0] > per_step[1]  # type: ignore[operator]
        kind = {
            (True, True): "steps and time per step",
            (True, False): "steps",
            (False, True): "time per step",
        }
        why = kind.get((more_steps, slower_steps), "neither factor alone")
        notes.append(
            Note(
                why,
                f"The default is not sooner than {label(name)}: {mine:.0f} s against {theirs:.0f} s "
                f"({mine - theirs:+.0f} s, {mine / theirs - 1:+.0%}). Steps ratio to DDP "
                f"{_fmt(steps[0])} against {_fmt(steps[1])}, time-per-step ratio {_fmt(per_step[0])} against "
                f"{_fmt(per_step[1])}: what costs it is {why}.",
            )
        )
    return notes


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)
