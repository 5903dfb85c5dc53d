"""benchmarks.parity.scale: each exchange priced as the inter-node traffic of an all-reduce over its
group, a run's record against the DDP-bf16 budget, and the table of runs against All-Reduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")

from benchmarks.parity import scale
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
    assert f"| 4 x 1 | 128 | {method} | 1 |" in text
    if method != "allreduce":  # each decentralized cell carries its difference to All-Reduce
        assert "(+" in text or "(-" in text
