"""benchmarks.parity.workers: --bleu scores the final average as eval.bleu does; the recipe's optim
settings reach the simulated ranks' optimizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("sacrebleu", reason="BLEU needs pip install '.[eval]'")

from benchmarks.parity import workers
from recipes.translation import synthetic

TINY = [
    "data.vocab_size=120", "model.layers=1", "model.d_model=16", "model.ffn_dim=32", "model.heads=2",
    "train.global_tokens=512", "data.val_limit=16",
]  # fmt: skip


def test_bleu_scores_the_final_average_on_the_test_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=6)
    out = tmp_path / "run.json"
    workers.main([
        "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--workers", "4", "--steps", "2",
        "--eval-every", "1", "--optimizer", "decentralized", "--bleu", "--out", str(out),
        f"data.cache_dir={tmp_path / 'cache'}", *TINY,
    ])  # fmt: skip
    result = json.loads(out.read_text())
    test = result["test"]
    assert test["split"] == result["config"]["data"]["test_split"] and test["sentences"] == 6
    assert 0.0 <= test["bleu"] <= 100.0 and test["bleu_signature"].startswith("nrefs:1")
    printed = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"bleu"')
    ]
    assert printed == [{"bleu": test["bleu"], "chrf": test["chrf"]}]
    assert [p["step"] for p in result["curve"]] == [1, 2]


def test_without_bleu_nothing_is_decoded(tmp_path: Path) -> None:
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=6)
    out = tmp_path / "run.json"
    workers.main([
        "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--workers", "2", "--steps", "1",
        "--optimizer", "allreduce", "--out", str(out), f"data.cache_dir={tmp_path / 'cache'}", *TINY,
    ])  # fmt: skip
    assert json.loads(out.read_text())["test"] is None


def test_the_simulated_ranks_send_bf16_updates_and_share_the_second_moment_when_asked(tmp_path: Path) -> None:
    """optim.exchange and optim.share_second_moment_every reach every simulated rank's
    DecentralizedAdam: bfloat16 updates from a shared reference round each step's update once, so the
    curve moves off the float32 exchange's, a little; the nodes' shared second moment moves it again."""
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=6)
    curves = {}
    variants = {
        "parameters": ["optim.exchange=parameters"],
        "bf16_updates": ["optim.exchange=bf16_updates"],
        "shared": ["optim.exchange=bf16_updates", "optim.share_second_moment_every=1"],
    }
    for name, options in variants.items():
        out = tmp_path / f"{name}.json"
        workers.main([
            "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--workers", "4", "--steps", "3",
            "--eval-every", "1", "--optimizer", "decentralized", "--out", str(out),
            f"data.cache_dir={tmp_path / 'cache'}", *TINY, "optim.intra_node=all_reduce",
            "optim.second_moment=group_gradient", "optim.topology=complete", *options,
        ])  # fmt: skip
        result = json.loads(out.read_text())
        assert result["config"]["optim"]["exchange"] == options[0].partition("=")[2]
        curves[name] = [p["valid_nll"] for p in result["curve"]]
    assert curves["bf16_updates"] != curves["parameters"]
    assert curves["bf16_updates"] == pytest.approx(curves["parameters"], rel=1e-3)
    assert curves["shared"] != curves["bf16_updates"]  # the floor V / N**2 from step 1, A from step 2


def test_a_synchronous_warm_up_runs_on_simulated_ranks_in_threads(tmp_path: Path) -> None:
    """Steps that wait for their own exchange run with every simulated rank in its own thread: on the
    complete graph each such step leaves every rank at the mean (no consensus distance), and the
    overlapped run differs."""
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=6)
    runs = {}
    for sync in (0, 3):
        out = tmp_path / f"sync{sync}.json"
        workers.main([
            "--preset", "demo-synthetic-en-de", "--data", str(corpus), "--workers", "4", "--steps", "3",
            "--eval-every", "1", "--optimizer", "decentralized", "--out", str(out),
            f"data.cache_dir={tmp_path / 'cache'}", *TINY, "optim.topology=complete",
            "optim.exchange=parameters", "optim.intra_node=gossip", f"optim.sync_steps={sync}",
        ])  # fmt: skip
        runs[sync] = json.loads(out.read_text())["curve"]
    assert [p["consensus_distance_rel"] for p in runs[3]] == [0.0, 0.0, 0.0]
    assert all(p["consensus_distance_rel"] > 0 for p in runs[0])
    assert [p["valid_nll"] for p in runs[3]] != [p["valid_nll"] for p in runs[0]]
