"""recipes.common: the command line, the run directory's one naming and keep_last rule, the optimizer
builder's parameter groups, the training clock, the launch command. No process group needed."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from decentadam import SETTINGS, DecentralizedAdam, GroupGradient, Setting, checkpoint_files
from decentadam.collectives import SingleProcessCommunicator
from decentadam.options import FLAT_OPTIONS
from recipes.common import cli, launch, loop, optim, run
from recipes.common.config import ConfigError, Presets, check_choice, check_positive


@dataclass
class Optim:
    optimizer: str = "decentralized"
    """The optimizer."""
    topology: str = "aer"
    """The graph."""
    accum_steps: int = 4
    """The window."""
    local_world_size: int = 0
    """Ranks per node."""


@dataclass
class Train:
    output_dir: str = "runs/x"
    """The run directory."""
    max_steps: int = 10
    """Steps."""


@dataclass
class Config:
    optim: Optim = field(default_factory=Optim)
    train: Train = field(default_factory=Train)


class FakeAccelerator:
    """What RunDirectory and out_of_time use of an Accelerator, in one process."""

    is_main_process = True
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.barriers = 0
        self.gathered: list[torch.Tensor] = []

    def wait_for_everyone(self) -> None:
        self.barriers += 1

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gathered.append(tensor)
        return tensor


def complete_checkpoint(path: Path, step: int) -> Path:
    checkpoint_files.state_dir(path).mkdir(parents=True)
    checkpoint_files.write_meta(path, checkpoint_files.RunShape(1, checkpoint_files.ALLREDUCE, None), step)
    return path


# The command line --------------------------------------------------------------------------------


def test_flags_override_the_preset_and_the_overrides(tmp_path: Path) -> None:
    (tmp_path / "mine.toml").write_text('[optim]\ntopology = "ring"\n[train]\nmax_steps = 3\n')
    presets = Presets(Config, tmp_path)
    args, cfg = cli.parse(
        "recipes.x.train", "doc", presets, ("allreduce", "decentralized"),
        ["train.max_steps=5", "--preset", "mine", "--accum-steps", "2", "optim.topology=complete",
         "--output-dir", "out", "--resume", "--local-world-size", "2"],
    )  # fmt: skip
    assert args.resume == "must" and cfg.train.max_steps == 5 and cfg.train.output_dir == "out"
    assert (cfg.optim.topology, cfg.optim.accum_steps, cfg.optim.local_world_size) == ("complete", 2, 2)
    _, flagged = cli.parse("x", "doc", presets, ("allreduce",), ["--preset", "mine", "--topology", "ring"])
    assert flagged.optim.topology == "ring" and flagged.optim.optimizer == "decentralized"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        cli.parse("x", "doc", presets, ("allreduce",), ["--preset", "mine", "--optimizer", "decentralized"])


@pytest.mark.parametrize(
    ("argv", "mode", "steps"),
    [
        ([], "none", 3),
        (["--resume"], "must", 3),
        (["--resume", "train.max_steps=7"], "must", 7),  # a bare --resume leaves the override alone
        (["train.max_steps=7", "--resume", "must"], "must", 7),
        (["--resume", "auto", "train.max_steps=7"], "auto", 7),
        (["--resume=auto"], "auto", 3),
    ],
)
def test_resume_is_none_must_or_auto(tmp_path: Path, argv: list[str], mode: str, steps: int) -> None:
    (tmp_path / "mine.toml").write_text("[train]\nmax_steps = 3\n")
    presets = Presets(Config, tmp_path)
    args, cfg = cli.parse("x", "doc", presets, ("allreduce",), ["--preset", "mine", *argv])
    assert (args.resume, cfg.train.max_steps) == (mode, steps)
    with pytest.raises(SystemExit):
        cli.parse("x", "doc", presets, ("allreduce",), ["--preset", "mine", "--resume=later"])


def test_bad_input_is_one_line_from_rank_zero_and_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def bad() -> None:
        raise ConfigError("train.max_steps = 0: expected a positive integer")

    for rank, printed in (("0", True), ("3", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stopped:
            cli.exit_on_bad_input(bad, (ConfigError,))
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert (err == "error: train.max_steps = 0: expected a positive integer\n") is printed
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        cli.exit_on_bad_input(bad, (ValueError,), any_rank=(ConfigError,))
    assert capsys.readouterr().err.startswith("error: train.max_steps")


def test_checks_name_the_setting_and_what_is_expected() -> None:
    with pytest.raises(
        ConfigError, match=r"optim\.optimizer = 'sgd': expected one of allreduce, decentralized"
    ):
        check_choice("optim.optimizer", "sgd", ("allreduce", "decentralized"))
    with pytest.raises(ConfigError, match=r"train\.max_steps = 0: expected a positive integer"):
        check_positive(Train(max_steps=0), "train", ("max_steps",))
    check_positive(Train(max_steps=0), "train", ("max_steps",), zero=True)
    with pytest.raises(ConfigError, match=r"train\.max_steps = -1: expected 0 or a positive integer"):
        check_positive(Train(max_steps=-1), "train", ("max_steps",), zero=True)


# The run directory --------------------------------------------------------------------------------


def test_checkpoints_are_complete_numbered_directories_in_step_order(tmp_path: Path) -> None:
    for step in (10, 9, 100):
        complete_checkpoint(tmp_path / run.step_name(step), step)
    complete_checkpoint(tmp_path / "checkpoint-50", 50)  # the Trainer integration's name
    (tmp_path / "step-200" / "decentadam").mkdir(parents=True)  # no meta.json: an interrupted save
    complete_checkpoint(tmp_path / ".step-300.incomplete", 300)  # a save's staging directory
    complete_checkpoint(tmp_path / "best", 7)  # not numbered
    assert [p.name for p in run.list_checkpoints(tmp_path)] == [
        "step-9",
        "step-10",
        "checkpoint-50",
        "step-100",
    ]
    assert run.list_checkpoints(tmp_path / "missing") == []


def test_keep_last_keeps_the_newest_and_zero_keeps_all(tmp_path: Path) -> None:
    accelerator = FakeAccelerator()
    directory = run.RunDirectory(tmp_path, accelerator)  # type: ignore[arg-type]
    for step in (1, 2, 3, 12):
        complete_checkpoint(directory.checkpoint(step), step)
    directory.prune(0)
    assert len(run.list_checkpoints(tmp_path)) == 4
    (tmp_path / ".step-2.deleting" / "decentadam").mkdir(parents=True)  # a prune killed half-way
    directory.prune(2)
    assert [p.name for p in run.list_checkpoints(tmp_path)] == ["step-3", "step-12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-12", "step-3"]  # no .deleting left
    assert accelerator.barriers == 2  # every rank waits for the deletion


def test_a_new_run_refuses_checkpoints_and_resume_takes_the_newest(tmp_path: Path) -> None:
    directory = run.RunDirectory(tmp_path / "run", FakeAccelerator())  # type: ignore[arg-type]
    assert directory.resume_from("none") is None
    with pytest.raises(ConfigError, match=r"--resume: .*run holds no complete checkpoint to resume from"):
        directory.resume_from("must")
    directory.write_config("[train]\n")
    directory.record({"step": 2, "train_seconds": 1.5})
    directory.record({"step": 4, "train_seconds": 3.0})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    complete_checkpoint(directory.checkpoint(4), 4)
    complete_checkpoint(directory.checkpoint(20), 20)
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(step-20\): pass --resume"):
        directory.resume_from("none")
    assert directory.resume_from("must") == tmp_path / "run" / "step-20"


def test_resume_auto_starts_fresh_without_a_checkpoint_and_resumes_the_newest_complete_one(
    tmp_path: Path,
) -> None:
    directory = run.RunDirectory(tmp_path / "run", FakeAccelerator())  # type: ignore[arg-type]
    assert directory.resume_from("auto") is None  # no directory yet
    (tmp_path / "run").mkdir()
    assert directory.resume_from("auto") is None  # empty
    # what a run killed before its first save leaves: its own files, a save's staging directory
    directory.write_config("[train]\n")
    directory.record({"step": 2})
    (tmp_path / "run" / "tb").mkdir()
    (tmp_path / "run" / ".step-2.incomplete" / "decentadam").mkdir(parents=True)
    assert directory.resume_from("auto") is None
    complete_checkpoint(directory.checkpoint(2), 2)
    complete_checkpoint(directory.checkpoint(4), 4)
    # killed while saving step 6 (no meta.json yet) and while deleting step 2 (renamed first)
    (tmp_path / "run" / "step-6" / "decentadam").mkdir(parents=True)
    (tmp_path / "run" / "step-6" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "run" / ".step-0.deleting").mkdir()
    assert directory.resume_from("auto") == directory.checkpoint(4)
    assert directory.resume_from("must") == directory.checkpoint(4)


def test_resume_auto_undoes_a_save_killed_between_its_two_renames(tmp_path: Path) -> None:
    directory = run.RunDirectory(tmp_path, FakeAccelerator())  # type: ignore[arg-type]
    complete_checkpoint(directory.checkpoint(2), 2)
    complete_checkpoint(checkpoint_files.sibling(directory.checkpoint(4), "previous"), 4)
    assert directory.resume_from("auto") == directory.checkpoint(4)
    assert not checkpoint_files.sibling(directory.checkpoint(4), "previous").exists()


@pytest.mark.parametrize("foreign", ["notes.txt", "data", "step-3"])
def test_resume_auto_refuses_a_directory_that_is_not_a_run(tmp_path: Path, foreign: str) -> None:
    directory = run.RunDirectory(tmp_path, FakeAccelerator())  # type: ignore[arg-type]
    complete_checkpoint(directory.checkpoint(2), 2)
    if foreign == "data":
        (tmp_path / foreign).mkdir()
    else:
        (tmp_path / foreign).write_text("not ours")  # step-3 as a file is not a checkpoint either
    expected = rf"output_dir {tmp_path} is not a run directory of this recipe: it holds {foreign}"
    with pytest.raises(ConfigError, match=expected + r".*Pass an output_dir that is new, empty or an"):
        directory.resume_from("auto")
    assert directory.resume_from("must") == directory.checkpoint(2)  # only auto guesses, so only auto refuses
    (tmp_path / "run-file").write_text("")
    with pytest.raises(ConfigError, match=r"is a file, not a run directory"):
        run.RunDirectory(tmp_path / "run-file", FakeAccelerator()).resume_from("auto")  # type: ignore[arg-type]


def test_a_restart_drops_the_metrics_of_the_steps_it_redoes(tmp_path: Path) -> None:
    directory = run.RunDirectory(tmp_path, FakeAccelerator())  # type: ignore[arg-type]
    directory.keep_metrics_until(4)  # no file yet: nothing to do
    for step in (2, 4, 6):
        directory.record({"step": step})
    directory.keep_metrics_until(4)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]


def test_the_chaos_save_delay_wraps_the_processor_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved: list[str] = []

    class Processor:
        def save_pretrained(self, directory: str) -> None:
            saved.append(directory)

    directory = run.RunDirectory(tmp_path, FakeAccelerator())  # type: ignore[arg-type]
    processor = Processor()
    monkeypatch.delenv(run.SAVE_DELAY_ENV, raising=False)
    assert directory.saving(processor) is processor
    monkeypatch.setenv(run.SAVE_DELAY_ENV, "0.2")
    slow = directory.saving(processor)
    begin = time.perf_counter()
    slow.save_pretrained("there")
    assert time.perf_counter() - begin >= 0.2 and saved == ["there"]


# The optimizer ------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 8)  # weight (8, 4): decayed; bias: not
        self.conv = nn.Conv2d(8, 8, 3, bias=False)  # kernel (8, 8, 3, 3): decayed
        self.norm = nn.LayerNorm(8)  # weight and bias: not decayed
        self.batch_norm = nn.BatchNorm2d(8)  # weight and bias: not decayed
        self.embedding = nn.Embedding(10, 4)  # (10, 4): decayed


def test_one_parameter_group_rule_decays_matrices_and_kernels_only() -> None:
    model = Block()
    decay, no_decay = optim.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert sorted(names[id(p)] for p in decay["params"]) == [
        "conv.weight",
        "embedding.weight",
        "linear.weight",
    ]
    assert sorted(names[id(p)] for p in no_decay["params"]) == [
        "batch_norm.bias", "batch_norm.weight", "linear.bias", "norm.bias", "norm.weight",
    ]  # fmt: skip


def settings(**changes: Any) -> optim.OptimConfig:
    base: dict[str, Any] = {
        "lr": 1e-3, "weight_decay": 0.1, "betas_allreduce": (0.9, 0.98), "betas_decentralized": (0.8, 0.999),
        "eps": 1e-8, "topology": "complete",
    }  # fmt: skip
    return optim.OptimConfig(**{**base, **changes})


class FourRanks(SingleProcessCommunicator):
    """As rank 2 of 4 (of 2 nodes of 2 where nodes are asked for), exchanges that finish at once."""

    rank, world_size = 2, 4


def test_the_builder_makes_each_optimizer_with_its_betas_and_the_groups() -> None:
    adamw = optim.build_optimizer(Block(), settings(optimizer="allreduce"))
    assert type(adamw) is torch.optim.AdamW and adamw.param_groups[0]["betas"] == (0.9, 0.98)
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
    sgd = optim.build_optimizer(Block(), settings(optimizer="allreduce", algorithm="sgd", momentum=0.8))
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.8
    ours = optim.build_optimizer(Block(), settings(local_world_size=4))
    assert isinstance(ours, DecentralizedAdam) and ours.param_groups[0]["betas"] == (0.8, 0.999)
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1, 0.0] and ours.world_size == 1
    assert ours.setting == Setting(topology="complete")
    ours.close()
    paper = optim.build_optimizer(Block(), settings(accum_steps=4, second_moment="local"))
    assert isinstance(paper, DecentralizedAdam) and paper.param_groups[0]["accum_steps"] == 4
    paper.close()
    chosen = optim.build_optimizer(Block(), settings(setting="accumadam", topology=None, lr=2.0), lr=3.0)
    assert isinstance(chosen, DecentralizedAdam) and chosen.setting == SETTINGS["accumadam"]
    assert chosen.param_groups[0]["lr"] == 3.0  # the recipe's scaled rate
    chosen.close()

    given = FourRanks()
    offline = optim.build_optimizer(Block(), settings(), communicator=given)
    assert isinstance(offline, DecentralizedAdam) and offline.communicator is given
    assert offline.world_size == 4
    offline.close()
    with pytest.raises(ConfigError, match=r"accum_steps=4 is the accumulation window .* setting='accumadam'"):
        optim.build_optimizer(Block(), settings(accum_steps=4, second_moment="all_ranks"))
    with pytest.raises(ConfigError, match=r"second_moment='global' averages"):
        optim.build_optimizer(
            Block(),
            settings(second_moment="global", topology="ring", exchange="parameters", average_every=0),
            communicator=given,
        )
    with pytest.raises(ConfigError, match="decentralized training runs DecentralizedAdam"):
        optim.build_optimizer(Block(), settings(algorithm="sgd"))
    with pytest.raises(ConfigError, match=r"optim\.optimizer = 'ddp'"):
        optim.build_optimizer(Block(), settings(optimizer="ddp"))
    assert optim.is_decentralized("a2cid2") and not optim.is_decentralized("allreduce")
    # A2CiD2 needs a process group: tests/test_imagenet_e2e.py builds it through this builder


def test_a_subclass_passed_in_is_what_the_builder_builds() -> None:
    class Probe(DecentralizedAdam):
        pass

    built = optim.build_optimizer(Block(), settings(), optimizer_class=Probe)
    assert type(built) is Probe
    built.close()


@pytest.mark.parametrize("recipe", ["translation", "imagenet"])
def test_the_recipes_share_one_optim_section(recipe: str) -> None:
    import importlib

    config = importlib.import_module(f"recipes.{recipe}.config")
    assert issubclass(config.OptimConfig, optim.OptimConfig)
    gossip = ["optim.intra_node=gossip", "optim.second_moment=group_gradient", "optim.v_every=3"]
    o = config.PRESETS.load(None, gossip).optim
    assert (o.second_moment, o.v_every) == ("group_gradient", 3)
    ours = optim.build_optimizer(Block(), o)
    assert isinstance(ours, DecentralizedAdam) and ours.setting.second_moment == GroupGradient(v_every=3)
    assert ours.moment_source.estimate_every == 3
    ours.close()
    unset = config.PRESETS.load(None, []).optim
    assert {name: getattr(unset, name) for name in FLAT_OPTIONS} == dict.fromkeys(FLAT_OPTIONS)
    default = optim.build_optimizer(Block(), unset)  # unset options: the library's default setting
    assert isinstance(default, DecentralizedAdam) and default.setting == SETTINGS["default"]
    assert default.moment_source.estimate_every is None
    default.close()
    # the effective configuration names every option, and reads back as the same setting
    written = optim.resolved(unset)
    assert written.topology == SETTINGS["default"].topology and written.second_moment == "global"
    assert optim.decentralized_setting(written) == SETTINGS["default"]
    with pytest.raises(ConfigError, match=r"v_every must be an integer >= 1 .* got 0"):
        optim.build_optimizer(
            Block(), settings(intra_node="gossip", second_moment="group_gradient", v_every=0)
        )
    with pytest.raises(ConfigError, match=r"A2CiD2's local AccumAdamW takes second_moment all_ranks"):
        optim.build_optimizer(Block(), settings(optimizer="a2cid2", second_moment="group_gradient"))


def test_the_effective_config_is_written_without_unset_options_and_reads_back(tmp_path: Path) -> None:
    from recipes.translation import config

    cfg = config.PRESETS.load(None, ["optim.setting=nodes-complete-bf16"])
    cfg.optim = optim.resolved(cfg.optim)
    (tmp_path / "run.toml").write_text(config.dump(cfg))
    again = config.PRESETS.load(str(tmp_path / "run.toml"), [])
    assert again.optim == cfg.optim and again.optim.v_every is None  # unset: not written, not read
    assert optim.decentralized_setting(again.optim) == SETTINGS["nodes-complete-bf16"]


# The loop -----------------------------------------------------------------------------------------


def test_the_clock_counts_only_between_start_and_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([10.0, 12.0, 20.0, 21.5])  # start, stop (2 s), start after an evaluation, stop (1.5 s)
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(ticks))
    clock = loop.TrainingClock(seconds=100.0)  # resumed from a checkpoint
    clock.start()
    assert clock.stop() == 102.0
    clock.start()
    assert clock.stop() == 103.5 and clock.seconds == 103.5
    with pytest.raises(RuntimeError, match=r"stop\(\) without start\(\)"):
        clock.stop()


def test_precision_and_the_time_limit() -> None:
    assert loop.mixed_precision("no") == "no" and loop.mixed_precision("fp16") == "fp16"
    expected = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    assert loop.mixed_precision("auto") == expected
    with pytest.raises(ConfigError, match=r"train\.mixed_precision = 'fp8': expected one of auto, no"):
        loop.mixed_precision("fp8")
    accelerator = FakeAccelerator()
    assert not loop.out_of_time(accelerator, 1e9, 0.0)  # type: ignore[arg-type]
    assert accelerator.gathered == []  # no limit: not even a collective
    assert not loop.out_of_time(accelerator, 59.0, 1.0)  # type: ignore[arg-type]
    assert loop.out_of_time(accelerator, 60.0, 1.0)  # type: ignore[arg-type]

    class TwoRanks(FakeAccelerator):  # rank 0 asks; rank 1's clock says `other`
        def __init__(self, other: float) -> None:
            super().__init__()
            self.other = other

        def gather(self, tensor: torch.Tensor) -> torch.Tensor:
            return torch.cat([tensor, torch.tensor([self.other])])

    # rank 0's clock decides, the one a report's train_seconds (and a budget taken from it) are
    assert not loop.out_of_time(TwoRanks(1.0), 59.0, 1.0)  # type: ignore[arg-type]
    assert loop.out_of_time(TwoRanks(0.0), 60.0, 1.0)  # type: ignore[arg-type]


# The launch command -------------------------------------------------------------------------------


def test_launch_command_runs_the_module_on_a_free_port_with_this_package_first() -> None:
    command = launch.accelerate_launch("recipes.translation.train", 4)
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[-2:] == ["-m", "recipes.translation.train"]
    assert command[command.index("--num_processes") + 1] == "4" and "--multi_gpu" in command
    assert command[command.index("--mixed_precision") + 1] == "no"
    port = int(command[command.index("--main_process_port") + 1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free: nobody listens there
    single = launch.accelerate_launch("recipes.imagenet.train", 1, gpu=True)
    assert "--multi_gpu" not in single and single[single.index("--mixed_precision") + 1] == "bf16"
    env = launch.environment()
    assert env["PYTHONPATH"].split(":")[0] == str(launch.ROOT) and env["ACCELERATE_USE_CPU"] == "true"
    assert (launch.ROOT / "recipes" / "__init__.py").is_file() and (
        launch.ROOT / "eval" / "contract.py"
    ).is_file()


def test_run_logged_echoes_progress_keeps_the_log_and_raises_with_its_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = "print('noise'); print('step 2  valid nll 1.0'); print('done: step 2')"
    seconds = launch.run_logged([sys.executable, "-c", script], tmp_path / "a.log", "demo")
    assert seconds > 0 and (tmp_path / "a.log").read_text().splitlines() == [
        "noise", "step 2  valid nll 1.0", "done: step 2",
    ]  # fmt: skip
    echoed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  [demo]")]
    assert echoed == ["  [demo] step 2  valid nll 1.0", "  [demo] done: step 2"]
    failing = [sys.executable, "-c", "print('error: no data'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)demo failed with exit code 3; .*error: no data"):
        launch.run_logged(failing, tmp_path / "b.log", "demo")


@pytest.mark.parametrize("recipe", ["translation", "imagenet"])
def test_the_recipes_share_the_nodes_second_moment_only_where_it_applies(recipe: str) -> None:
    import importlib

    chosen = [
        "optim.intra_node=all_reduce", "optim.second_moment=group_gradient", "optim.topology=complete",
        "optim.share_second_moment_every=2",
    ]  # fmt: skip
    o = importlib.import_module(f"recipes.{recipe}.config").PRESETS.load(None, chosen).optim
    assert o.share_second_moment_every == 2
    shared = optim.build_optimizer(
        Block(), dataclasses.replace(o, local_world_size=2), world_size=4, communicator=FourRanks()
    )
    assert isinstance(shared, DecentralizedAdam) and shared.setting.share_every == 2
    assert shared.moment_source.floor_ranks == 4  # V / N**2 with N = 2 nodes
    shared.close()
    for changes, named in [
        ({"second_moment": "all_ranks"}, "second_moment='all_ranks'"),
        ({"intra_node": "gossip"}, "intra_node='gossip'"),
    ]:
        given = {"intra_node": "all_reduce", "second_moment": "group_gradient", **changes}
        with pytest.raises(ConfigError, match=rf"share_second_moment_every=2 shares .*{named}"):
            optim.build_optimizer(Block(), settings(share_second_moment_every=2, **given))
    with pytest.raises(ConfigError, match=r"--optimizer allreduce does not take it"):
        optim.build_optimizer(Block(), settings(optimizer="allreduce", share_second_moment_every=2))
    with pytest.raises(ConfigError, match=r"share_second_moment_every must be an integer >= 0 .* got -1"):
        optim.build_optimizer(
            Block(),
            settings(second_moment="group_gradient", intra_node="all_reduce", share_second_moment_every=-1),
        )


@pytest.mark.parametrize("recipe", ["translation", "imagenet"])
def test_the_recipes_pass_a_synchronous_warm_up_to_decentralized_adam_only(recipe: str) -> None:
    import importlib

    o = importlib.import_module(f"recipes.{recipe}.config").PRESETS.load(None, ["optim.sync_steps=300"]).optim
    assert o.sync_steps == 300
    synced = optim.build_optimizer(Block(), o, world_size=4, communicator=FourRanks())
    assert isinstance(synced, DecentralizedAdam) and synced.setting.sync_steps == 300
    synced.close()
    with pytest.raises(
        ConfigError, match=r"optim.sync_steps = 300 .* --optimizer allreduce does not take it"
    ):
        optim.build_optimizer(Block(), settings(optimizer="allreduce", sync_steps=300))
    with pytest.raises(ConfigError, match=r"sync_steps must be an integer >= 0 .* got -1"):
        optim.build_optimizer(Block(), settings(sync_steps=-1))


def test_build_optimizer_passes_the_exchange_to_decentralized_adam_only() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = optim.build_optimizer(model, settings(exchange="bf16_updates", topology="complete"))
    assert isinstance(optimizer, DecentralizedAdam) and optimizer.setting.exchange == "bf16_updates"
    with pytest.raises(ConfigError, match=r"optim\.exchange = 'bf16_updates' changes what DecentralizedAdam"):
        optim.build_optimizer(model, settings(optimizer="allreduce", exchange="bf16_updates"))
    with pytest.raises(ConfigError, match=r"exchange must be 'parameters' or 'bf16_updates', got 'fp8'"):
        optim.build_optimizer(model, settings(exchange="fp8"))
    # a preset serves both optimizers: All-Reduce ignores the options that send nothing different
    assert type(optim.build_optimizer(model, settings(optimizer="allreduce", second_moment="local"))) is (
        torch.optim.AdamW
    )
