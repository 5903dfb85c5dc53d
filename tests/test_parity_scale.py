"""benchmarks.parity.scale: each exchange priced as the inter-node traffic of an all-reduce over its
group, a run's record against the DDP-bf16 budget, and the table of runs against All-Reduce."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")

from benchmarks.parity import scale, scale_table
from recipes.translation import synthetic

TINY = [
    "data.vocab_size=120", "model.layers=1", "model.d_model=16", "model.ffn_dim=32", "model.heads=2",
    "train.global_tokens=512", "data.val_limit=16",
]  # fmt: skip


def test_an_exchange_is_priced_as_its_group_s_inter_node_traffic() -> None:
    counter = scale.Counter(nodes=4, ranks_per_node=2)  # ranks 0-1 on node 0, 2-3 on node 1, ...
    buffer = torch.zeros(100, dtype=torch.bfloat16)  # 200 bytes
    counter.add(0, buffer, (0, 1))  # inside one node: free
    assert counter.inter_node_bytes[0] == 0.0 and not counter.global_steps
    counter.step = 3
    counter.add(0, buffer, (0, 2))  # two nodes, one rank each: 2 (2 - 1) / 2 x 200
    assert counter.inter_node_bytes[0] == pytest.approx(200.0)
    assert not counter.global_steps
    counter.add(5, buffer, tuple(range(8)))  # every node, 2 ranks each sharing the node's 2 (3/4) 200
    assert counter.inter_node_bytes[5] == pytest.approx(2 * 3 / 4 * 200 / 2)
    assert counter.global_steps == {3}


@pytest.mark.parametrize("method", ["allreduce", "exp-avg16", "sync-exp-avg4-global"])
def test_a_run_records_its_bytes_against_the_budget_and_the_table_compares_it(
    tmp_path: Path, method: str
) -> None:
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=6)
    out = tmp_path / "runs"
    common = [
        "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--nodes", "4", "--steps", "4",
        "--eval-every", "2", "--out", str(out), f"data.cache_dir={tmp_path / 'cache'}", *TINY,
    ]  # fmt: skip
    scale.main(["run", "--method", "allreduce", *common])
    if method != "allreduce":
        scale.main(["run", "--method", method, *common])
    record = json.loads((out / f"{method}-n4x1-s1.json").read_text())
    s = record["parameter_bytes"]
    assert record["ddp_bf16_bytes_per_step"] == pytest.approx(2 * 3 / 4 * s / 2)
    assert [p["step"] for p in record["curve"]] == [2, 4]
    if method == "allreduce":
        assert record["inter_node_bytes_per_step"] == pytest.approx(2 * 3 / 4 * s)
        assert record["global_collectives_per_step"] == 1.0
    elif method == "exp-avg16":  # no exact average in 4 steps: one peer, a bf16 update (S/2) each step
        assert record["inter_node_bytes_per_step"] == pytest.approx(s / 2)
        assert record["global_collectives_per_step"] == 0.0
        assert record["optimizer_bytes_sent_per_step"] == pytest.approx(s / 2)
    else:  # steps 1-3 one peer (S/2 each); step 4 the exact average of the bf16 update and of the ranks'
        # second-moment estimates (bf16), each priced 2 (4 - 1) / 4 x S/2 across the 4 nodes
        assert record["inter_node_bytes_per_step"] == pytest.approx((3 * s / 2 + 2 * 1.5 * s / 2) / 4)
        assert record["global_collectives_per_step"] == 0.25
        assert record["optimizer_bytes_sent_per_step"] == pytest.approx(5 * s / 2 / 4)
    page = tmp_path / "README.md"
    scale.main(["table", str(out), "--out", str(page)])
    text = page.read_text()
    assert record["lr"] == 2e-3  # the preset's
    assert f"| 4 x 1 | 128 | {method}{' *' if method == 'allreduce' else ''} | 0.002 | 1 |" in text
    if method != "allreduce":  # each decentralized cell carries its difference to All-Reduce
        assert "(+" in text or "(-" in text


def fake_run(method: str, lr_word: str | None, curve: list[float], seed: int = 1) -> dict[str, object]:
    """A run record as benchmarks.parity.scale writes it, made before ``lr`` was recorded."""
    command = f"python -m benchmarks.parity.scale run --nodes 16 --method {method} --seed {seed}"
    return {
        "nodes": 16, "ranks_per_node": 1, "tokens_per_rank": 256, "method": method, "about": method,
        "is_default": method == "default", "seed": seed, "steps": 100 * len(curve),
        "inter_node_bytes_per_step": 1.0, "ddp_bf16_bytes_per_step": 2.0, "global_collectives_per_step": 0.0,
        "command": command + (f" {lr_word}" if lr_word else ""),
        "curve": [{"step": 100 * (i + 1), "valid_nll": v} for i, v in enumerate(curve)],
    }  # fmt: skip


def test_the_table_compares_every_rate_with_all_reduce_at_its_best_rate(tmp_path: Path) -> None:
    folders = {name: tmp_path / name for name in ("runs", "lr-1e-3", "lr-4e-3")}
    for folder in folders.values():
        folder.mkdir()
    runs = {
        "runs/allreduce": fake_run("allreduce", None, [5.0, 4.0, 3.5, 3.0, 2.0]),  # the preset's 2e-3
        "lr-1e-3/allreduce": fake_run("allreduce", "optim.lr=1e-3", [4.5, 3.9, 3.6, 3.5]),  # behind at 400
        "runs/default": fake_run("default", None, [5.5, 4.5, 4.2, 4.0]),
        "lr-1e-3/default": fake_run("default", "optim.lr=1e-3", [5.2, 4.4, 4.0, 3.6]),
        "lr-1e-3/exp": fake_run("exp", "optim.lr=1e-3", [5.3, 4.6]),  # stopped before step 400
        # the default's options under another name, seed 1 again but shorter: one seed in the summary
        "lr-1e-3/exp-avg32-global": fake_run("exp-avg32-global", "optim.lr=1e-3", [5.2, 4.4]),
        "lr-4e-3/allreduce": fake_run(
            "allreduce", "optim.lr=4e-3", []
        ),  # stopped before its first evaluation
    }
    for name, run in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    page = tmp_path / "README.md"
    scale.main(["table", *map(str, folders.values()), "--out", str(page)])
    text = page.read_text()
    assert "| 16 x 1 | 256 | allreduce * | 0.002 | 1 |" in text  # 3.0 < 3.5 at step 400, the last shared
    assert "| 16 x 1 | 256 | allreduce | 0.001 | 1 |" in text
    row = (
        "| 16 x 1 | 256 | default (default) | {} | 1 | 0.50 | 0.000 | {} | "  # then step 500: All-Reduce only
    )
    assert row.format("0.001", "5.200 (+0.200) | 4.400 (+0.400) | 4.000 (+0.500) | 3.600 (+0.600)") in text
    assert row.format("0.002", "5.500 (+0.500) | 4.500 (+0.500) | 4.200 (+0.700) | 4.000 (+1.000)") in text
    assert "| 16 x 1 | 256 | exp | 0.001 | 1 | 0.50 | 0.000 | 5.300 (+0.300) | 4.600 (+0.600) |" in text
    assert "| 16 x 1 | default | 0.001 | +0.600 (1) |  |" in text  # 3.6 - 3.0, seed 1 counted once
    assert "| 16 x 1 | 256 | exp-avg32-global (= default) | 0.001 | 1 |" in text
    assert "| 16 x 1 | default | 0.002 | +1.000 (1) |  |" in text
    assert "| 16 x 1 | exp |" not in text  # no step 400: no summary row


@pytest.mark.parametrize(("nodes", "per_node"), [(16, 1), (8, 2)])
def test_a_method_s_name_keeps_its_options_whatever_the_default_and_the_candidate_is_the_default(
    nodes: int, per_node: int
) -> None:
    """Every method but ``default`` starts from the grid's base (the default when the grid began),
    so committed runs keep their meaning; ``exp-avg32-global``, the candidate the grid chose, is
    ``DecentralizedAdam()``'s default on both layouts, so its runs are the default's."""
    from benchmarks.parity.workers import setting_options
    from decentadam import Setting, make_setting

    def setting(name: str) -> Setting:
        return make_setting(**setting_options(scale.method_options(name, nodes, per_node)))

    inside = "all_reduce" if per_node > 1 else "gossip"
    # on nodes of one rank a node's all-reduce is no exchange at all: the same run
    # (test_decentralized: test_the_default_equals_the_simulation_of_n_workers_in_one_process)
    assert (
        setting("default")
        == Setting()
        == dataclasses.replace(setting("exp-avg32-global"), intra_node="all_reduce")
    )
    assert setting("exp-avg32-global").intra_node == inside
    assert scale_table.SAME_AS_DEFAULT == ("exp-avg32-global",)  # the table counts its runs as the default's
    assert setting("exp") == Setting(
        topology="one-peer-exp",
        exchange="parameters",
        average_every=0,
        intra_node=inside,
        second_moment="all_ranks",
    )
    previous = Setting(
        topology="aer", exchange="parameters", average_every=0, intra_node="gossip", second_moment="all_ranks"
    )
    assert setting("aer-all-ranks") == previous
    assert scale.method_options("aer-all-ranks", nodes, per_node)["local_world_size"] == per_node
    assert scale.method_options("allreduce", nodes, per_node) == {}
