"""The workers table: every method at every worker count, differences to All-Reduce, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")

from benchmarks.parity import workers_table
from recipes.translation import synthetic

TINY = [
    "data.vocab_size=120", "model.layers=1", "model.d_model=16", "model.ffn_dim=32", "model.heads=2",
    "train.global_tokens=512", "data.val_limit=16",
]  # fmt: skip


def test_table_runs_each_method_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=4)
    out = tmp_path / "table"
    argv = [
        "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--workers", "2", "4", "--steps", "2",
        "--eval-every", "1", "--out", str(out), f"data.cache_dir={tmp_path / 'cache'}", *TINY,
    ]  # fmt: skip
    workers_table.main(argv)
    names = sorted(p.name for p in out.glob("*-n*.json"))
    assert names == sorted(workers_table.run_name(m, n) for m in workers_table.METHODS for n in (2, 4))
    table = json.loads((out / "workers.json").read_text())["results"]
    for n in ("2", "4"):
        assert table["All-Reduce"][n]["tokens_per_worker"] == 512 // int(n)
        assert [p["step"] for p in table["all_ranks (default)"][n]["curve"]] == [1, 2]
    # the rendered differences are the runs' own numbers
    markdown = (out / "workers.md").read_text()
    run = table["own v (local)"]["4"]["curve"][1]["valid_nll"]
    reference = table["All-Reduce"]["4"]["curve"][1]["valid_nll"]
    assert f"{run:.3f} ({run - reference:+.3f})" in markdown
    rows = len(workers_table.METHODS)
    assert markdown.count("\n| 2 | 256 |") == rows and markdown.count("\n| 4 | 128 |") == rows
    # 2 workers are one node of 2 (the preset's local_world_size): averaging gradients in it is
    # All-Reduce (AdamW on the mean gradient; group_gradient's estimate is the mean's square)
    node = [p["valid_nll"] for p in table["nodes (intra_node=all_reduce)"]["2"]["curve"]]
    assert node == pytest.approx([p["valid_nll"] for p in table["All-Reduce"]["2"]["curve"]], rel=1e-5)
    two_nodes = [p["valid_nll"] for p in table["nodes (intra_node=all_reduce)"]["4"]["curve"]]
    assert two_nodes != pytest.approx([p["valid_nll"] for p in table["All-Reduce"]["4"]["curve"]], rel=1e-5)
    # sharing the nodes' second moment: nothing to share on one node, a different run on two
    shared = table["nodes, second moment shared every 2 steps"]
    assert [p["valid_nll"] for p in shared["2"]["curve"]] == pytest.approx(node, rel=1e-5)
    assert [p["valid_nll"] for p in shared["4"]["curve"]] != pytest.approx(two_nodes, rel=1e-5)

    # a second call finds every run on disk and only renders
    capsys.readouterr()
    workers_table.main(argv)
    assert "==" not in capsys.readouterr().out
    assert (out / "workers.md").read_text() == markdown
