"""``decentadam-plot`` (issue 46, item 4): the curves of existing runs, from their ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="decentadam-plot needs pip install '.[recipes]'")

from recipes import plot

OPTIM_AER = """[optim]
optimizer = "decentralized"
lr = 0.002
topology = "aer"
intra_node = "gossip"
second_moment = "all_ranks"
accum_steps = 1
average_every = 0
sync_steps = 0
local_world_size = 2
"""


def write_run(path: Path, points: list[dict[str, float]], optim: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    if optim is not None:
        (path / "config.toml").write_text(optim)
    return path


def translation_points(scale: float, train_loss: bool = True) -> list[dict[str, float]]:
    return [
        {"step": s, "train_seconds": scale * s, "valid_nll": 6.0 - s / 100, "epoch": 0}
        | ({"train_loss": 6.5 - s / 90} if train_loss else {})
        for s in (100, 200, 300)
    ]


def test_plot_draws_each_runs_numbers_against_steps_and_time_with_their_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    aer = write_run(tmp_path / "aer", translation_points(0.5), OPTIM_AER)
    allreduce = '[optim]\noptimizer = "allreduce"\nlr = 0.001\n'
    ddp = write_run(tmp_path / "ddp", translation_points(1.0, train_loss=False), allreduce)
    out = tmp_path / "figures" / "curves.png"
    runs = plot.main([str(aer), str(ddp), "--out", str(out), "--title", "t"])
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    assert [r.label for r in runs] == [
        "aer (decentralized: aer, second moment all_ranks, lr 0.002)",
        "ddp (allreduce, lr 0.001)",
    ]
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == ["aer", "300", "2.5", "3.0000", f"{6.5 - 300 / 90:.4f}"]
    assert printed[2].split() == ["ddp", "300", "5.0", "3.0000", "-"]  # no train_loss recorded

    figure = plot.plot_runs(runs, tmp_path / "again.pdf")
    valid_steps, valid_time, train_steps, train_time = figure.axes  # rows: validation, training loss
    lines = {line.get_label(): line for line in valid_steps.get_lines()}
    assert list(lines[runs[0].label].get_xdata()) == [100, 200, 300]
    assert list(lines[runs[0].label].get_ydata()) == pytest.approx([5.0, 4.0, 3.0])
    by_time = {line.get_label(): line for line in valid_time.get_lines()}
    assert list(by_time[runs[1].label].get_xdata()) == pytest.approx([100 / 60, 200 / 60, 300 / 60])
    trained = {line.get_label(): list(line.get_ydata()) for line in train_steps.get_lines()}
    assert trained[runs[0].label] == pytest.approx([6.5 - s / 90 for s in (100, 200, 300)])
    assert trained[runs[1].label] == []
    assert len(train_time.get_lines()) == 2


def test_image_runs_get_a_top1_row_and_recipes_are_not_mixed(tmp_path: Path) -> None:
    points = [
        {"step": s, "train_seconds": s, "top1": s / 40, "top5": 1.0, "loss": 2 - s / 20} for s in (10, 20)
    ]
    image = write_run(tmp_path / "mnist", points)
    figure = plot.plot_runs([plot.read_run(image)], tmp_path / "mnist.png")
    assert len(figure.axes) == 6 and figure.axes[4].get_ylabel() == "validation top-1 accuracy"
    assert "no train_loss recorded" in [t.get_text() for t in figure.axes[2].texts]
    text = write_run(tmp_path / "m30k", translation_points(1.0))
    with pytest.raises(plot.PlotError, match="different recipes"):
        plot.plot_runs([plot.read_run(image), plot.read_run(text)], tmp_path / "mixed.png")


def fails(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int | str | None, str]:
    with pytest.raises(SystemExit) as exit_:
        plot.main(list(args))
    return exit_.value.code, capsys.readouterr().err


def test_what_cannot_be_drawn_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "run", translation_points(1.0))
    out = str(tmp_path / "c.png")
    code, err = fails(capsys, str(tmp_path / "nowhere"), "--out", out)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path / 'nowhere' / 'metrics.jsonl'} does not exist (the directory")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    code, err = fails(capsys, str(tmp_path / "empty"), "--out", out)
    assert code == 2 and "is empty: the run has not finished its first evaluation" in err

    broken = write_run(tmp_path / "broken", translation_points(1.0))
    with open(broken / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4')
    code, err = fails(capsys, str(broken), "--out", out)
    assert code == 2 and f"{broken / 'metrics.jsonl'}, line 4: not JSON" in err

    code, err = fails(capsys, str(run), "--label", "a", "--label", "b", "--out", out)
    assert code == 2 and "2 --label for 1 runs" in err

    (tmp_path / "file").write_text("")
    code, err = fails(capsys, str(run), "--out", str(tmp_path / "file" / "c.png"))
    assert code == 6 and err.startswith("error: --out") and err.count("\n") == 1
    assert not (tmp_path / "c.png").exists()
