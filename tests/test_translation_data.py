"""Translation recipe, in one process: tokenizer and its cache, token-budget batches, config, bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("transformers", reason="the translation recipe needs pip install '.[recipes]'")

from recipes.common.launch import environment
from recipes.common.optim import resolved
from recipes.translation import compare, config, data, synthetic, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write(tmp_path_factory.mktemp("synthetic"), train=1500, val=50, test=50)


def write_text(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# Tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_is_trained_once_then_cached_and_loads_with_auto_tokenizer(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    sources, targets = data.read_local(corpus, "train", "en", "de")
    tokenizer, first = data.build_tokenizer([sources, targets], 400, tmp_path / "cache")
    assert first.parent == tmp_path / "cache" and (first / "tokenizer.json").is_file()
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1 and len(tokenizer) <= 400
    sentence = targets[0]
    ids = tokenizer(sentence)["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == sentence  # lossless on normalised text

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(data, "train_tokenizer", no_training)
    again, second = data.build_tokenizer([sources, targets], 400, tmp_path / "cache")
    assert second == first and again(sentence)["input_ids"] == ids
    monkeypatch.undo()
    # other text or another vocabulary size is another cache entry
    _, other_text = data.build_tokenizer([sources[:-1], targets[:-1]], 400, tmp_path / "cache")
    _, other_size = data.build_tokenizer([sources, targets], 300, tmp_path / "cache")
    assert len({first, other_text, other_size}) == 3
    # loaded from a path, and with AutoTokenizer from a checkpoint-like directory
    loaded, where = data.build_tokenizer([], 0, tmp_path / "unused", path=str(first))
    assert where == first and loaded(sentence)["input_ids"] == ids
    tokenizer.save_pretrained(tmp_path / "checkpoint")
    assert AutoTokenizer.from_pretrained(tmp_path / "checkpoint")(sentence)["input_ids"] == ids


def test_encode_drops_overlong_pairs_and_collate_shifts_labels(corpus: Path, tmp_path: Path) -> None:
    sources, targets = data.read_local(corpus, "val", "en", "de")
    tokenizer, _ = data.build_tokenizer([sources, targets], 300, tmp_path)
    everything = data.encode(tokenizer, sources, targets)
    short = data.encode(tokenizer, sources, targets, max_length=12)
    assert len(everything) == len(sources) and 0 < len(short) < len(sources)
    assert max(short.src_lengths.max(), short.tgt_lengths.max()) <= 12
    batch = data.collate(everything, np.array([0, 1, 2]), pad_id=0)
    labels, decoder_inputs = batch["labels"], batch["decoder_input_ids"]
    assert decoder_inputs[:, 0].eq(0).all() and labels.shape == decoder_inputs.shape
    kept = labels[:, :-1] != -100
    assert decoder_inputs[:, 1:][kept].equal(labels[:, :-1][kept])
    assert batch["attention_mask"].sum(1).tolist() == everything.src_lengths[:3].tolist()


# Batching -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world_size", "multiple_of"), [(1, 1), (4, 1), (4, 3)])
def test_token_batches_budget_coverage_and_disjoint_shards(world_size: int, multiple_of: int) -> None:
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(2, 60, size=997), rng.integers(2, 60, size=997)
    src[5] = 400  # longer than the budget: a batch of its own
    lengths = np.maximum(src, tgt)
    budget = 300
    shards = [
        data.TokenBatches(
            src, tgt, budget, seed=3, rank=r, world_size=world_size, multiple_of=multiple_of
        ).epoch_batches(epoch=2)
        for r in range(world_size)
    ]
    assert len({len(shard) for shard in shards}) == 1 and len(shards[0]) % multiple_of == 0
    for shard in shards:
        for batch in shard:
            assert len(batch) == 1 or len(batch) * lengths[batch].max() <= budget
    seen = np.concatenate([batch for shard in shards for batch in shard])
    assert sorted(seen.tolist()) == list(range(997))  # every example once per epoch, over all ranks


def test_token_batches_order_depends_on_seed_and_epoch_only() -> None:
    rng = np.random.default_rng(1)
    src, tgt = rng.integers(2, 40, size=500), rng.integers(2, 40, size=500)

    def order(seed: int, epoch: int, rank: int = 1) -> list[list[int]]:
        batches = data.TokenBatches(src, tgt, 200, seed=seed, rank=rank, world_size=4)
        return [b.tolist() for b in batches.epoch_batches(epoch)]

    # a restarted run (a new object) continues the same order: epoch_batches(e)[b:] after b batches
    assert order(0, 3) == order(0, 3)
    assert order(0, 3) != order(0, 4) and order(0, 3) != order(1, 3)
    # length grouping: batches hold examples of similar length
    lengths = np.maximum(src, tgt)
    spreads = [int(lengths[b].max() - lengths[b].min()) for b in map(np.array, order(0, 0))]
    assert np.median(spreads) <= 1
    evaluation = data.TokenBatches(src, tgt, 200, shuffle=False).epoch_batches(0)
    flat = np.concatenate(evaluation)
    assert (np.diff(lengths[flat]) >= 0).all()


# Configuration --------------------------------------------------------------------------------


def test_presets_load_and_the_effective_config_round_trips(tmp_path: Path) -> None:
    for name in config.PRESETS.names():
        config.load(name)
    base = config.load("wmt14-en-de-base")
    assert (base.model.layers, base.model.d_model, base.model.ffn_dim, base.model.heads) == (6, 512, 2048, 8)
    assert base.optim.lr == 7e-4 and base.optim.warmup_steps == 4000 and base.optim.eps == 1e-9
    assert base.optim.betas_allreduce == (0.9, 0.98) and base.optim.betas_decentralized == (0.9, 0.999)
    assert resolved(base.optim).accum_steps == 4 and base.optim.label_smoothing == 0.1
    assert base.train.global_tokens == 25000 and base.model.dropout == 0.1
    big = config.load("wmt14-en-fr-big")
    assert (big.model.d_model, big.model.ffn_dim, big.model.heads, big.data.tgt) == (1024, 4096, 16, "fr")
    cfg = config.load(
        "multi30k-en-de",
        ["data=/x/y", "train.max_steps=7", "lr=0.002", "optim.betas_decentralized=[0.8, 0.99]", "heads=2"],
    )
    assert cfg.data.path == "/x/y" and cfg.train.max_steps == 7 and cfg.optim.lr == 0.002
    assert cfg.optim.betas_decentralized == (0.8, 0.99) and cfg.model.heads == 2
    (tmp_path / "effective.toml").write_text(config.dump(cfg))
    assert config.load(str(tmp_path / "effective.toml")) == cfg


# Bad input: each error names the file (and line) or key, and what is expected -------------------


def test_missing_file_names_it_and_the_languages_there(corpus: Path) -> None:
    with pytest.raises(data.DataError, match=r"missing data file .*train\.fr.*train exists in de, en"):
        data.read_local(corpus, "train", "en", "fr")
    with pytest.raises(data.DataError, match=r"data directory .*nowhere does not exist"):
        data.read_local(corpus / "nowhere", "train", "en", "de")


def test_line_count_mismatch_names_both_files_and_counts(tmp_path: Path) -> None:
    write_text(tmp_path / "train.en", ["a b", "c d", "e f"])
    with gzip.open(tmp_path / "train.de.gz", "wt", encoding="utf-8") as handle:
        handle.write("a b\nc d\n")
    expected = r"train\.en has 3 lines but .*train\.de\.gz has 2.*after line 2"
    with pytest.raises(data.DataError, match=expected):
        data.read_local(tmp_path, "train", "en", "de")


def test_empty_file_and_empty_line_are_named(tmp_path: Path) -> None:
    write_text(tmp_path / "train.en", [])
    write_text(tmp_path / "train.de", ["x"])
    with pytest.raises(data.DataError, match=r"train\.en is empty: expected one sentence per line"):
        data.read_local(tmp_path, "train", "en", "de")
    write_text(tmp_path / "train.en", ["one", "two", "", "four"])
    with pytest.raises(data.DataError, match=r"train\.en, line 3, is empty"):
        data.read_local(tmp_path, "train", "en", "de")


def test_unknown_language_pair() -> None:
    expected = r"unknown language pair en-ja for wmt/wmt14: expected one of .*de-en"
    with pytest.raises(data.DataError, match=expected):
        data.hub_config("wmt/wmt14", "en", "ja")
    assert data.hub_config("wmt/wmt14", "en", "de") == "de-en"
    with pytest.raises(data.DataError, match=r"unknown language pair en-en"):
        data.read_local(".", "train", "en", "en")


def test_unknown_preset_key_and_bad_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=r"unknown preset 'nope': expected one of .*multi30k-en-de"):
        config.load("nope")
    expected = r"unknown config key train\.max_step; \[train\] has .*max_steps"
    with pytest.raises(config.ConfigError, match=expected):
        config.load("multi30k-en-de", ["train.max_step=3"])
    with pytest.raises(config.ConfigError, match=r"unknown config key 'bogus'"):
        config.load("multi30k-en-de", ["bogus=3"])
    with pytest.raises(config.ConfigError, match=r"train\.max_steps = 'many': expected int"):
        config.load("multi30k-en-de", ["train.max_steps=many"])
    preset = write_text(tmp_path / "mine.toml", ["[model]", "layers = 2", "widht = 3"])
    with pytest.raises(config.ConfigError, match=r"mine\.toml: unknown config key model\.widht"):
        config.load(str(preset))


def test_train_script_reports_bad_input_before_training(corpus: Path, tmp_path: Path) -> None:
    """The module itself: one line on stderr, exit code 2, and nothing written to the run directory."""
    run = tmp_path / "run"
    process = subprocess.run(
        [sys.executable, "-m", "recipes.translation.train", "--preset", "demo-synthetic-en-de",
         f"train.output_dir={run}", f"data={corpus}", "data.tgt=fr"],
        capture_output=True, text=True, timeout=120, env=environment(),
    )  # fmt: skip
    assert process.returncode == 2, process.stderr[-2000:]
    assert process.stderr.strip().startswith("error: ") and "missing data file" in process.stderr
    assert not (run / "config.toml").exists()
    # more bad input, to the same main in this process: the error that the module prints with exit code
    # 2 (tests/test_recipes_common.py checks that wrapper)
    for overrides, kind, message in [
        ([f"data={corpus}", "model.depth=3"], config.ConfigError, "unknown config key model.depth"),
        (["data=wmt/wmt14", "data.tgt=ja"], data.DataError, "unknown language pair en-ja"),
    ]:
        with pytest.raises(kind, match=message):
            train.main(["--preset", "demo-synthetic-en-de", f"train.output_dir={run}", *overrides])
        assert not (run / "config.toml").exists()


# Comparison report ----------------------------------------------------------------------------


def test_compare_report_keeps_the_other_run_only_when_the_arguments_match(tmp_path: Path) -> None:
    header = {"preset": "p", "data": "d", "steps": 10, "processes": 4, "overrides": ["a=1"]}
    run = {"bleu": 12.5}
    (tmp_path / "report.json").write_text(json.dumps({**header, "runs": {"allreduce": run}}))

    assert compare.start_report(tmp_path, header)["runs"] == {"allreduce": run}
    assert compare.start_report(tmp_path, {**header, "steps": 20})["runs"] == {}
    assert compare.start_report(tmp_path, {**header, "overrides": []})["runs"] == {}
    assert compare.start_report(tmp_path / "missing", header) == {**header, "runs": {}}


def test_compare_summary_gives_the_steps_to_reach_all_reduces_losses() -> None:
    def run(curve: list[tuple[int, float]]) -> dict[str, object]:
        points = [{"step": s, "valid_nll": v, "train_seconds": 2.0 * s} for s, v in curve]
        return {"bleu": 1.0, "chrf": 2.0, "bleu_signature": "sig", "final_valid_nll": points[-1]["valid_nll"],
                "train_seconds": 800.0, "wall_seconds": 900.0, "curve": points}  # fmt: skip

    allreduce = run([(100, 1.341), (200, 0.068), (300, 0.042), (400, 0.035)])
    decentralized = run([(100, 1.369), (200, 0.067), (300, 0.040), (400, 0.044)])
    lines = compare.summary({"runs": {"allreduce": allreduce, "decentralized": decentralized}}).splitlines()

    assert lines[-3].split(maxsplit=1)[1].strip() == "+0.028 / -0.001 / -0.002 / +0.009"
    assert lines[-2].startswith("steps to reach All-Reduce (DDP + AdamW)'s valid nll")
    # 1.341 is crossed 2.2 steps after step 100 on the chord to 0.067; 0.068 just before step 200;
    # 0.042 between 200 and 300; 0.035 never (0.040 is the lowest)
    assert lines[-1].split(maxsplit=2)[-1] == "102 (1.02x) / 200 (1.00x) / 293 (0.98x) / not reached"


def test_compare_plot_draws_each_run_against_time_and_steps(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib (pip install '.[bench]')")
    from tests.pictures import assert_drawn

    curves = {
        "allreduce": [{"step": s, "train_seconds": 60.0 * s, "valid_nll": 5.0 - s / 10} for s in (10, 20)],
        "decentralized": [
            {"step": s, "train_seconds": 30.0 * s, "valid_nll": 5.5 - s / 10} for s in (10, 20)
        ],
    }
    report = {
        "preset": "multi30k-en-de",
        "processes": 4,
        "steps": 20,
        "runs": {name: {"curve": curve, "bleu": 30.0 + i} for i, (name, curve) in enumerate(curves.items())},
    }
    figure = compare.plot(report, tmp_path / "report.png")

    assert figure.texts[0].get_text() == "multi30k-en-de, 4 processes, 20 steps"
    by_time, by_step = figure.axes[:2]
    assert "training time" in by_time.get_xlabel() and by_step.get_xlabel() == "optimizer steps"
    for axes, x_of in ((by_time, lambda p: p["train_seconds"] / 60), (by_step, lambda p: p["step"])):
        lines = {line.get_label(): line for line in axes.get_lines()}
        assert set(lines) == {
            "All-Reduce (DDP + AdamW): BLEU 30.00",
            "DecentralizedAdam (decentadam): BLEU 31.00",
        }
        for (label, line), points in zip(lines.items(), curves.values(), strict=True):
            assert list(line.get_xdata()) == [x_of(p) for p in points], label
            assert list(line.get_ydata()) == [p["valid_nll"] for p in points], label
    assert_drawn(tmp_path / "report.png", (1320, 480))  # what was saved: the 11 x 4 inch figure at 120 dpi
