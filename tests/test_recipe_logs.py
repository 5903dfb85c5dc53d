"""What a recipe run tells its user (issue 46): a one-process decentralized run says what it trains;
stderr in a file gets plain lines, one per log step, or JSON lines (``--log-format json``); the
trackers of ``train.report_to`` get the configuration and the run says where its logs are."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the recipes need pip install '.[recipes]'")
pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("tensorboard", reason="the recipes log to TensorBoard")

from recipes.common import optim, trackers
from recipes.common.config import ConfigError
from recipes.common.launch import environment
from recipes.common.loop import one_process_note
from recipes.translation import synthetic
from recipes.translation import train as text_train

TINY = [
    "--preset", "demo-synthetic-en-de", "data.vocab_size=200", "model.layers=1", "model.d_model=16",
    "model.ffn_dim=32", "model.heads=2", "train.global_tokens=512", "train.mixed_precision=no",
    "train.max_steps=2", "train.log_every=1", "train.eval_every=2", "train.save_every=2", "data.val_limit=8",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write(tmp_path_factory.mktemp("corpus"), train=200, val=16, test=4)


def tiny(corpus: Path, run: Path, *args: str) -> list[str]:
    return [
        *TINY,
        f"data={corpus}",
        f"data.cache_dir={run.parent / 'cache'}",
        f"train.output_dir={run}",
        *args,
    ]


def test_a_decentralized_run_on_one_process_says_once_that_it_is_plain_adam(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text_train.main(tiny(corpus, tmp_path / "run", "--optimizer", "decentralized"))
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert output.count("one process: --optimizer decentralized has no other rank to average with") == 1
    assert "plain Adam (AccumAdam with s = 1)" in output
    assert "accelerate launch --multi_gpu --num_processes N -m recipes.translation.train" in output
    assert "torchrun --nproc-per-node N -m recipes.translation.train" in output

    text_train.main(tiny(corpus, tmp_path / "baseline", "--optimizer", "allreduce"))
    assert "one process" not in "".join(capsys.readouterr())


def test_the_note_names_the_local_optimizer_and_is_absent_on_several_processes() -> None:
    def settings(**changes: object) -> optim.OptimConfig:
        return optim.resolved(optim.OptimConfig(**changes))  # type: ignore[arg-type]

    accum = one_process_note("recipes.imagenet.train", settings(optimizer="decentralized", accum_steps=4), 1)
    assert accum is not None and "plain AccumAdam (consensus distance 0)" in accum
    sgd = one_process_note("recipes.imagenet.train", settings(optimizer="a2cid2", algorithm="sgd"), 1)
    assert sgd is not None and "plain SGD with momentum" in sgd
    assert one_process_note("m", settings(optimizer="decentralized"), 2) is None
    assert one_process_note("m", settings(optimizer="allreduce"), 1) is None


LOG_LINE = re.compile(
    r"^step (\d+)/2  loss \d+\.\d{3}  tok/s \d+  consensus \d\.\de[+-]\d\d  eta \d+:\d\d:\d\d$"
)


def test_stderr_to_a_file_gets_one_plain_line_per_log_step_and_the_rank_messages(
    corpus: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "recipes.translation.train",
        *tiny(corpus, run, "--optimizer", "decentralized"),
    ]
    log = tmp_path / "train.log"
    with open(log, "w") as stderr:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=environment(), timeout=300
        )
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    assert "\r" not in text
    lines = text.splitlines()
    assert [int(m.group(1)) for line in lines if (m := LOG_LINE.match(line))] == [1, 2], text
    assert sum(line.startswith("rank 0: first optimizer step") for line in lines) == 1
    assert any(line.startswith("step 2  valid nll ") for line in lines)


def test_log_format_json_writes_one_object_per_line(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text_train.main(tiny(corpus, tmp_path / "run", "--optimizer", "decentralized", "--log-format", "json"))
    err = capsys.readouterr().err
    records = [json.loads(line) for line in err.splitlines()]  # every line is a JSON object
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["eta_s"] >= 0 and r["decentadam/consensus_distance_rel"] == 0 for r in steps)
    assert steps[0]["message"].startswith("step 1/2  loss ")
    assert [r["rank"] for r in records if r["message"].startswith("rank 0: first optimizer step")] == [0]
    assert [r["step"] for r in records if "valid/nll" in r] == [2]


def test_a_bar_on_request_and_an_unknown_format_refused(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text_train.main(tiny(corpus, tmp_path / "run", "--optimizer", "allreduce", "train.log_format=bar"))
    err = capsys.readouterr().err
    assert "\r" in err and "loss=" in err  # tqdm's bar with its postfix
    assert not LOG_LINE.match(err.splitlines()[-1])
    with pytest.raises(
        ConfigError, match=r"train.log_format = 'lines': expected one of auto, bar, text, json$"
    ):
        text_train.main(tiny(corpus, tmp_path / "bad", "train.log_format=lines"))


def test_report_to_tensorboard_records_the_config_and_none_writes_no_tracker_files(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    board = tmp_path / "board"
    text_train.main(tiny(corpus, board, "--optimizer", "decentralized"))  # the default: tensorboard
    err = capsys.readouterr().err
    assert f"run directory {board}: open the logs with `tensorboard --logdir {board / 'tb'}`" in err
    assert list((board / "tb").rglob("events.out.tfevents.*"))
    (hparams,) = (board / "tb").rglob("hparams.yml")
    recorded = yaml.safe_load(hparams.read_text())
    assert recorded["optim.optimizer"] == "decentralized" and recorded["world_size"] == 1
    assert recorded["model.d_model"] == 16 and recorded["optim.betas_decentralized"] == "[0.9, 0.98]"

    quiet = tmp_path / "quiet"
    text_train.main(tiny(corpus, quiet, "--optimizer", "decentralized", "train.report_to=none"))
    assert f"run directory {quiet}: no tracker (train.report_to=none)" in capsys.readouterr().err
    assert sorted(p.name for p in quiet.iterdir()) == ["config.toml", "metrics.jsonl", "step-2"]


def test_report_to_maps_to_accelerates_trackers_and_refuses_one_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "m30k"
    assert trackers.trackers("tensorboard", run) == (["tensorboard"], {})
    assert trackers.trackers("none", run) == (None, {})
    wandb = {"wandb": {"name": "m30k", "dir": str(run)}}
    assert trackers.trackers("wandb", run) == (["wandb"], wandb)
    assert trackers.trackers("all", run) == (["all"], wandb)
    assert "project decentadam, run m30k" in trackers.where_logs_are("wandb", run)

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else found(name))
    with pytest.raises(
        ConfigError, match=r"report_to = 'wandb', but wandb is not installed: pip install wandb"
    ):
        text_train.main(tiny(tmp_path, run, "train.report_to=wandb"))
    with pytest.raises(
        ConfigError, match=r"report_to = 'mlflow': expected one of tensorboard, wandb, all, none$"
    ):
        text_train.main(tiny(tmp_path, run, "train.report_to=mlflow"))
    assert not run.exists()  # refused before anything started


def test_the_tracker_config_is_flat_scalars_without_unset_options() -> None:
    cfg = text_train.config.load("demo-synthetic-en-de", ["optim.accum_steps=2"])
    flat = trackers.tracker_config(cfg, world_size=4)
    assert flat["optim.accum_steps"] == 2 and flat["world_size"] == 4 and flat["data.src"] == "en"
    assert flat["optim.betas_allreduce"] == "[0.9, 0.98]"
    assert "optim.sync_steps" not in flat  # unset: None is no tracker's value
    assert all(isinstance(v, (int, float, str, bool)) for v in flat.values())
