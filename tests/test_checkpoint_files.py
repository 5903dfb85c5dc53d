"""Rank files are safe to load: only tensors and plain values, read with torch.load(weights_only=True).

A crafted rank file whose pickle would run a command is refused (and the command does not run);
rank files of the earlier format (NumPy's RNG state as a NumPy array) are refused with the command
that converts them, which then makes them load; a state that is not plain is refused at save time.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn

from decentadam import DecentralizedAdam, Setting
from decentadam import checkpoint_files as files
from decentadam.checkpoint import load_checkpoint, save_checkpoint


def saved(tmp_path: Path) -> tuple[Path, nn.Module, DecentralizedAdam]:
    """A one-process checkpoint (weights, AccumAdam state, scheduler, RNG) and what wrote it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = DecentralizedAdam(
        model.parameters(), lr=0.1, accum_steps=2, setting=Setting(second_moment="local")
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.5)
    model(torch.ones(1, 3)).sum().backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    scheduler.step()
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, model, optimizer, scheduler=scheduler, extra={"step": 1})
    return directory, model, optimizer


def draws() -> tuple[float, float, float]:
    return random.random(), float(torch.rand(())), float(numpy.random.rand())


class Payload:
    """Unpickling it calls os.system: what a crafted checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def test_a_rank_file_holds_only_tensors_and_plain_values_and_restores_every_rng(tmp_path: Path) -> None:
    directory, model, optimizer = saved(tmp_path)
    state = torch.load(files.rank_file(directory, 0), weights_only=True)  # no allowlist needed
    assert set(state) == {"model", "optimizer", "scheduler", "scaler", "rng"}
    assert set(state["rng"]) == {"python", "torch", "numpy"}
    expected = draws()  # the streams right after the save
    random.seed(1), torch.manual_seed(1), numpy.random.seed(1)
    assert load_checkpoint(directory, model, optimizer) == {"step": 1}
    assert draws() == expected


@pytest.mark.parametrize("form", ["torch.save", "bare pickle"])
def test_a_rank_file_with_a_pickle_payload_is_refused_and_runs_nothing(tmp_path: Path, form: str) -> None:
    directory, model, optimizer = saved(tmp_path)
    marker = tmp_path / "payload-ran"
    file = files.rank_file(directory, 0)
    crafted = {"model": Payload(marker), "optimizer": None, "scheduler": None, "scaler": None, "rng": {}}
    if form == "torch.save":
        torch.save(crafted, file)
    else:
        file.write_bytes(pickle.dumps(crafted, protocol=2))
    with pytest.raises(files.RefusedRankFile) as refused:
        load_checkpoint(directory, model, optimizer)
    message = str(refused.value)
    assert str(file) in message and "not loaded" in message and "Resume from a checkpoint" in message
    if form == "torch.save":
        assert "posix.system" in message or "os.system" in message  # what it would have called
    assert not marker.exists(), "the payload ran"


def write_old_format(directory: Path, rank: int) -> tuple[float, float, float]:
    """Rewrite a rank file as decentadam 0.1.0 did (NumPy's RNG state as a NumPy array), with RNG
    states captured now; returns the draws that follow them."""
    file = files.rank_file(directory, rank)
    state = torch.load(file, weights_only=True)
    state["rng"] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": numpy.random.get_state(),  # (name, ndarray of 624 uint32, position, has_gauss, gauss)
    }
    torch.save(state, file)
    return draws()


def test_a_rank_file_of_the_earlier_format_is_refused_with_the_command_that_converts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, model, optimizer = saved(tmp_path)
    expected = write_old_format(directory, 0)
    with pytest.raises(files.RefusedRankFile, match=r"python -m decentadam\.checkpoint_files upgrade"):
        load_checkpoint(directory, model, optimizer)

    assert files.main(["upgrade", str(directory)]) == 0
    assert "1 rank file(s) converted" in capsys.readouterr().out
    torch.load(files.rank_file(directory, 0), weights_only=True)  # plain now
    random.seed(1), torch.manual_seed(1), numpy.random.seed(1)
    assert load_checkpoint(directory, model, optimizer) == {"step": 1}
    assert draws() == expected  # the NumPy stream too
    assert files.upgrade_rank_files(directory) == []  # nothing left to convert


def test_upgrading_refuses_a_payload_too(tmp_path: Path) -> None:
    directory, _, _ = saved(tmp_path)
    marker = tmp_path / "payload-ran"
    crafted = {"rng": {"numpy": numpy.random.get_state()}, "model": Payload(marker)}
    torch.save(crafted, files.rank_file(directory, 0))
    with pytest.raises(files.RefusedRankFile, match="refused to load"):
        files.upgrade_rank_files(directory)
    assert not marker.exists()


def test_a_state_that_is_not_plain_is_refused_at_save_time_naming_the_entry(tmp_path: Path) -> None:
    directory, model, optimizer = saved(tmp_path)

    class Schedule:  # a scheduler whose state holds an object
        def state_dict(self) -> dict[str, Any]:
            return {"last_epoch": 3, "warmup": numpy.arange(3)}

    with pytest.raises(TypeError, match=r"\['scheduler'\]\['warmup'\] is a numpy.ndarray"):
        save_checkpoint(directory, model, optimizer, scheduler=Schedule(), extra={"step": 2})
    assert files.read_meta(directory)["extra"] == {"step": 1}  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_check_plain_accepts_state_dicts_and_refuses_subclasses() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.AdamW(model.parameters())
    files.check_plain({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "state")
    files.check_plain({"size": torch.Size([2]), "dtype": torch.float16, "device": torch.device("cpu")}, "s")
    with pytest.raises(TypeError, match=r"state\[0\] is a .*Point"):
        from typing import NamedTuple

        class Point(NamedTuple):
            x: int

        files.check_plain([Point(1)], "state")


def test_loading_needs_a_torch_without_the_weights_only_hole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, _, _ = saved(tmp_path)
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(RuntimeError, match="CVE-2025-32434"):
        files.load_rank_state(directory, 0)
