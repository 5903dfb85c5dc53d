"""decentadam.options: the settings a user picks from, and one home of the rules about which options go
together: each refused combination gets the same error through the optimizer, a recipe's [optim]
section and the Trainer's arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

from decentadam import (
    SETTINGS,
    AllRanks,
    Comm,
    DecentralizedAdam,
    Global,
    GroupGradient,
    Local,
    Setting,
    make_setting,
)
from decentadam.options import DEFAULT_SETTING
from decentadam.simulation import SimulatedCluster
from recipes.common import optim
from recipes.common.config import ConfigError


def params() -> Any:
    return nn.Linear(2, 2).parameters()


def test_each_setting_is_one_line_to_select() -> None:
    assert SETTINGS[DEFAULT_SETTING] == Setting() == make_setting()
    assert DecentralizedAdam(params(), lr=1e-3).setting == Setting()
    for name, setting in SETTINGS.items():
        assert DecentralizedAdam(params(), lr=1e-3, setting=name).setting == setting
        assert make_setting(**setting.flat()) == setting  # what a configuration file writes reads back
    assert SETTINGS["accumadam"] == Setting(
        topology="aer",
        exchange="parameters",
        average_every=0,
        intra_node="gossip",
        second_moment=Local(accum_steps=4),
    )
    chosen = SETTINGS["nodes-complete-bf16"]
    assert (chosen.topology, chosen.exchange, chosen.intra_node) == ("complete", "bf16_updates", "all_reduce")
    assert (chosen.second_moment, chosen.sync_steps) == (GroupGradient(share_second_moment_every=2), 300)


def test_the_paper_s_accumadam_is_its_window_alone() -> None:
    """``DecentralizedAdam(params, lr, accum_steps=s)``, as the paper writes AccumAdam, is the preset
    "accumadam" with that window; with another setting named, a window is refused naming the preset."""
    paper = DecentralizedAdam(params(), lr=1e-3, accum_steps=8)
    assert paper.setting == dataclasses.replace(SETTINGS["accumadam"], second_moment=Local(accum_steps=8))
    assert (paper.setting.topology, paper.setting.exchange, paper.setting.intra_node) == (
        "aer",
        "parameters",
        "gossip",
    )
    assert paper.param_groups[0]["accum_steps"] == 8
    assert DecentralizedAdam(params(), accum_steps=4).setting == SETTINGS["accumadam"]
    assert DecentralizedAdam(params(), accum_steps=1).setting == SETTINGS[DEFAULT_SETTING]  # no window
    with pytest.raises(ValueError, match=r"accum_steps=4 is the accumulation window .* setting='accumadam'"):
        DecentralizedAdam(params(), setting="default", accum_steps=4)
    ring = DecentralizedAdam(params(), setting=Setting(topology="ring", second_moment="local"), accum_steps=2)
    assert ring.setting == Setting(topology="ring", second_moment=Local(2))


def test_names_and_kinds_of_second_moments() -> None:
    assert Setting(second_moment="group_gradient").second_moment == GroupGradient()
    assert [type(Setting(second_moment=n).second_moment) for n in ("all_ranks", "local", "global")] == [
        AllRanks,
        Local,
        Global,
    ]
    nodes = Setting(intra_node="all_reduce", second_moment="group_gradient")
    gossip = Setting(intra_node="gossip", second_moment="group_gradient")
    assert (nodes.v_every, gossip.v_every, Setting().v_every) == (1, 2, None)
    with pytest.raises(ValueError, match="second_moment must be one of"):
        Setting(second_moment=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"comm must be a decentadam\.options\.Comm"):
        DecentralizedAdam(params(), comm={"timeout": 3})  # type: ignore[arg-type]


def test_a_given_second_moment_replaces_the_setting_s_and_its_parameters_go_with_it() -> None:
    chosen = make_setting("nodes-complete-bf16", second_moment="all_ranks")
    assert chosen.second_moment == AllRanks() and chosen.exchange == "bf16_updates"
    assert make_setting("nodes-complete-bf16", share_second_moment_every=4).share_every == 4
    assert make_setting("accumadam", accum_steps=8).second_moment == Local(8)
    assert make_setting(second_moment="local", accum_steps=2, topology="ring") == Setting(
        "ring", second_moment=Local(2)
    )


REFUSED: list[tuple[dict[str, Any], Callable[[], DecentralizedAdam] | None]] = [
    # (the options as a configuration file holds them, the same written with the typed API, if it can be)
    (
        {"accum_steps": 4, "second_moment": "all_ranks"},
        lambda: DecentralizedAdam(params(), setting=Setting(second_moment=AllRanks()), accum_steps=4),
    ),
    (
        {"setting": "default", "accum_steps": 4},
        lambda: DecentralizedAdam(params(), setting="default", accum_steps=4),
    ),
    ({"setting": "fast"}, lambda: DecentralizedAdam(params(), setting="fast")),
    ({"v_every": 2}, None),  # Global has no v_every
    ({"second_moment": "local", "v_every": 1}, None),
    (
        {"second_moment": "group_gradient", "v_every": 0},
        lambda: DecentralizedAdam(params(), setting=Setting(second_moment=GroupGradient(v_every=0))),
    ),
    (
        {"intra_node": "all_reduce", "second_moment": "group_gradient", "v_every": 2},
        lambda: DecentralizedAdam(
            params(), setting=Setting(intra_node="all_reduce", second_moment=GroupGradient(v_every=2))
        ),
    ),
    (
        {"intra_node": "gossip", "second_moment": "group_gradient", "share_second_moment_every": 2},
        lambda: DecentralizedAdam(
            params(),
            setting=Setting(intra_node="gossip", second_moment=GroupGradient(share_second_moment_every=2)),
        ),
    ),
    ({"intra_node": "all_reduce", "share_second_moment_every": 2}, None),  # Global shares nothing
    ({"exchange": "fp8"}, lambda: DecentralizedAdam(params(), setting=Setting(exchange="fp8"))),  # type: ignore[arg-type]
    ({"intra_node": "node"}, lambda: DecentralizedAdam(params(), setting=Setting(intra_node="node"))),  # type: ignore[arg-type]
    ({"topology": "star"}, lambda: DecentralizedAdam(params(), setting=Setting(topology="star"))),
    ({"second_moment": "nodes"}, lambda: DecentralizedAdam(params(), setting=Setting(second_moment="nodes"))),  # type: ignore[arg-type]
    ({"sync_steps": -1}, lambda: DecentralizedAdam(params(), setting=Setting(sync_steps=-1))),
    ({"average_every": -2}, lambda: DecentralizedAdam(params(), setting=Setting(average_every=-2))),
]


@pytest.mark.parametrize(("flat", "typed"), REFUSED, ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_a_refused_combination_gets_the_same_error_everywhere(
    flat: dict[str, Any], typed: Callable[[], DecentralizedAdam] | None
) -> None:
    from decentadam.integrations.trainer import DecentralizedArguments

    with pytest.raises(ValueError) as library:
        make_setting(**flat)
    message = str(library.value)
    if typed is not None:  # the optimizer, given the same options as values
        with pytest.raises(ValueError) as error:
            typed()
        assert str(error.value) == message
    with pytest.raises(ConfigError) as error:  # a recipe's [optim] section
        optim.build_optimizer(nn.Linear(2, 2), optim.OptimConfig(**flat))
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:  # the Trainer's arguments, before any training
        DecentralizedArguments(**flat)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "flat",
    [
        # changing pairs, no exact average to renew r at
        {"exchange": "bf16_updates", "topology": "ring", "average_every": 0},
        # no exact average to share v at
        {"second_moment": "global", "topology": "one-peer-exp", "average_every": 0},
    ],
)
def test_what_the_job_s_size_rules_out_is_refused_alike_by_the_optimizer_and_a_recipe(
    flat: dict[str, Any],
) -> None:
    def communicator() -> Any:
        return SimulatedCluster(4).communicator(0)

    with pytest.raises(ValueError) as library:
        DecentralizedAdam(params(), setting=make_setting(**flat), comm=Comm(communicator=communicator()))
    assert "pass average_every=k" in str(library.value)
    with pytest.raises(ConfigError) as error:
        optim.build_optimizer(nn.Linear(2, 2), optim.OptimConfig(**flat), communicator=communicator())
    assert str(error.value) == str(library.value)
    fixed = make_setting(**{**flat, "average_every": 4})  # the fix the message names
    DecentralizedAdam(params(), setting=fixed, comm=Comm(communicator=communicator())).close()


@pytest.mark.parametrize(
    ("comm", "match"),
    [
        ({"bucket_size_mb": 0}, "bucket_size_mb must be > 0"),
        ({"overlap": "sometimes"}, "overlap must be 'step' or 'backward'"),
        ({"timeout": 0}, "timeout must be > 0 seconds or None"),
        ({"local_world_size": 0}, "local_world_size must be an integer >= 1 or None"),
        ({"hierarchical": False, "communicator": SimulatedCluster(2).communicator(0)}, "hierarchical=False"),
    ],
)
def test_bad_communication_options_name_the_problem(comm: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Comm(**comm)


def test_the_default_schedules_exact_averages_only_where_there_are_nodes_to_average() -> None:
    """On one node of replicas the default has nothing to average (no exact average, no second
    moment shared, so no bfloat16 reference point); from two nodes on, every 32nd step is one."""
    assert Setting().schedule(4, 4).name == "one-peer-exp" and Setting().schedule(1, 1).world_size == 1
    assert Setting().schedule(8, 4).name == Setting().schedule(4, 1).name == "one-peer-exp+avg32"
