"""The count of token types seen by one node only: by hand on a tiny corpus, and on the recipe's data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")

from benchmarks.parity import node_tokens
from recipes.translation import data, synthetic


def encoded(pairs: list[tuple[list[int], list[int]]]) -> data.Encoded:
    src_offsets = np.cumsum([0] + [len(s) for s, _ in pairs])
    tgt_offsets = np.cumsum([0] + [len(t) for _, t in pairs])
    return data.Encoded(
        np.concatenate([s for s, _ in pairs]), src_offsets, np.concatenate([t for _, t in pairs]), tgt_offsets
    )


def test_counts_by_hand() -> None:
    corpus = encoded([([1, 2], [5, 6]), ([2, 3], [6, 7]), ([1, 1], [5, 5]), ([4, 2], [8, 6])])
    # 4 ranks, nodes (0, 1) and (2, 3), one step: node 0 holds pairs 0, 1; node 1 pairs 2, 3
    batches = [[np.array([0])], [np.array([1])], [np.array([2])], [np.array([3])]]
    got = node_tokens.node_token_stats(corpus, batches, ranks_per_node=2, steps=5)
    # src: node 0 {1, 2, 3}, node 1 {1, 2, 4}: alone 3 and 4 of 4 types, 2 of 8 tokens
    expected = {"types_one_node": 0.5, "occurrences_one_node": 0.25, "types": 4, "tokens": 8, "steps": 1}
    assert got["src"] == expected
    # tgt: node 0 {5, 6, 7}, node 1 {5, 6, 8}: alone 7 and 8
    assert got["tgt"]["types_one_node"] == 0.5 and got["tgt"]["occurrences_one_node"] == 0.25
    with pytest.raises(ValueError, match="at least 2 whole nodes"):
        node_tokens.node_token_stats(corpus, batches[:2], ranks_per_node=2, steps=1)


def test_main_on_the_recipe_data(tmp_path: Path) -> None:
    corpus = synthetic.write(tmp_path / "corpus", train=200, val=16, test=4)
    out = tmp_path / "tokens.json"
    node_tokens.main(
        [
            "--data", str(corpus), "--presets", "demo-synthetic-en-de", "--seeds", "1", "2", "--steps", "3",
            "--out", str(out), f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=120",
            "train.global_tokens=512",
        ]
    )  # fmt: skip
    results = json.loads(out.read_text())["results"]["demo-synthetic-en-de"]
    for seed in ("1", "2"):
        for side in ("src", "tgt"):
            counts = results[seed][side]
            assert counts["steps"] == 3 and 0 < counts["types_one_node"] < 1
            # the types both nodes hold are the frequent ones
            assert 0 < counts["occurrences_one_node"] < counts["types_one_node"]
    assert results["1"] != results["2"]  # another seed, another data order
