"""eval.bleu on checkpoints that from_pretrained loads, built here without the recipe; its command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sacrebleu", reason="eval.bleu needs pip install '.[recipes]'")
pytest.importorskip("tokenizers", reason="eval.bleu needs pip install '.[recipes]'")

from decentadam import checkpoint_files
from eval import bleu, contract
from recipes.common.launch import environment

SOURCES = ["a small dog runs .", "the cat sleeps .", "two birds sing in a tree .", "a man reads ."]
TARGETS = [
    "ein kleiner Hund rennt .",
    "die Katze schläft .",
    "zwei Vögel singen in einem Baum .",
    "ein Mann liest .",
]


def save_checkpoint(directory: Path, seed: int) -> Any:
    """A random tiny Marian model and a word-level tokenizer, written with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import MarianConfig, MarianMTModel, PreTrainedTokenizerFast

    words = sorted({w for line in SOURCES + TARGETS for w in line.split()})
    vocabulary = {token: i for i, token in enumerate(["<pad>", "</s>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=len(vocabulary), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=1,
    )  # fmt: skip
    model = MarianMTModel(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def write_test_set(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "test.en").write_text("".join(s + "\n" for s in SOURCES))
    (directory / "test.de").write_text("".join(t + "\n" for t in TARGETS))
    return directory


def test_evaluate_scores_a_checkpoint_and_writes_hypotheses_only_when_asked(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "model", seed=0)
    data = write_test_set(tmp_path / "data")
    result = bleu.evaluate(tmp_path / "model", str(data), "test", "en", "de", max_len_b=4)
    assert result["beam"] == 4 and result["length_penalty"] == 0.6 and result["sentences"] == len(SOURCES)
    assert result["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert result["hypotheses"] is None and sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )  # nothing written into the checkpoint
    again = bleu.evaluate(
        tmp_path / "model", str(data), "test", "en", "de", max_len_b=4, hypotheses=tmp_path / "out" / "h.txt"
    )
    assert again["bleu"] == result["bleu"]
    assert len((tmp_path / "out" / "h.txt").read_text().splitlines()) == len(SOURCES)


def test_command_line_prints_json_writes_output_and_exits_with_the_error_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_checkpoint(tmp_path / "model", seed=0)
    data = write_test_set(tmp_path / "data")
    common = ["--data", str(data), "--src", "en", "--tgt", "de", "--max-len-b", "4"]
    # the entry point, once, in a process of its own: the JSON on stdout and in --output, exit code 0
    done = subprocess.run(
        [sys.executable, "-m", "eval.bleu", str(tmp_path / "model"), *common,
         "--output", str(tmp_path / "out" / "scores.json")],
        capture_output=True, text=True, timeout=120, env=environment(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout)  # stdout holds the JSON and nothing else
    assert printed == json.loads((tmp_path / "out" / "scores.json").read_text())
    assert printed["sentences"] == len(SOURCES) and printed["checkpoints"] == [str(tmp_path / "model")]
    assert (
        "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in done.stderr
        and "chrF2|" in done.stderr
    )

    def command_line(*args: str) -> tuple[int | str | None, str, str]:
        """The same command line in this process (what its ``__main__`` runs): exit code, stdout, stderr."""
        with pytest.raises(SystemExit) as exit_info:
            contract.main(bleu.parser(), bleu._evaluate, list(args), summary=bleu._summary)
        out, err = capsys.readouterr()
        return exit_info.value.code, out, err

    code, out, err = command_line(str(tmp_path / "model"), *common[:-4], "--tgt", "fr")
    assert code == 3 and "error: missing data file" in err
    assert out == ""
    code, _, err = command_line(str(data), *common)
    assert code == 4 and f"error: {data / 'config.json'} does not exist: expected a directory that" in err
    code, _, err = command_line(str(tmp_path / "model"), "--average-last", "2", *common)
    assert code == 4 and "holds no complete checkpoint" in err
    (tmp_path / "taken").mkdir()
    code, _, err = command_line(str(tmp_path / "model"), *common, "--output", str(tmp_path / "taken"))
    assert code == 6 and "is a folder: give a file name" in err
    assert command_line(str(tmp_path / "model"))[0] == 2  # argparse: --data and friends missing


def test_translate_keeps_input_order_across_length_sorted_batches(tmp_path: Path) -> None:
    model = save_checkpoint(tmp_path / "model", seed=1).eval()
    loaded, tokenizer, _ = bleu.load_model(tmp_path / "model", 0, torch.float32)
    kwargs: dict[str, Any] = {"beam": 2, "length_penalty": 0.6, "max_len_b": 3, "device": "cpu"}
    one_by_one = [bleu.translate(loaded, tokenizer, [s], max_tokens=10_000, **kwargs)[0] for s in SOURCES]
    batched = bleu.translate(loaded, tokenizer, SOURCES, max_tokens=20, **kwargs)  # several batches
    assert batched == one_by_one
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True)
    )


def test_average_last_k_averages_the_weights_of_the_last_complete_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    models = [save_checkpoint(run / f"step-{step}", seed=step) for step in (5, 10, 20, 30)]
    for step in (5, 10, 20):  # complete: decentadam's metadata, as save_checkpoint writes it last
        checkpoint_files.state_dir(run / f"step-{step}").mkdir()
        checkpoint_files.write_meta(
            run / f"step-{step}", checkpoint_files.RunShape(1, "allreduce", None), step
        )
    # step-30 has weights but no metadata: an interrupted save, not a checkpoint
    averaged, _, used = bleu.load_model(run, 2, torch.float32)
    assert [p.name for p in used] == ["step-10", "step-20"]
    expected = {
        k: (models[1].state_dict()[k] + models[2].state_dict()[k]) / 2 for k in models[2].state_dict()
    }
    for key, value in averaged.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(value, expected[key], atol=1e-6), key
    assert bleu.score(["ein Mann liest ."], ["ein Mann liest ."])["bleu"] == 100.0


def command_line(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int | str | None, str, str]:
    """``python -m eval.bleu ARGS`` in this process: exit code (0 when it scored), stdout, stderr."""
    capsys.readouterr()  # not what came before (save_pretrained's bar)
    try:
        contract.main(bleu.parser(), bleu._evaluate, list(args), summary=bleu._summary)
        code: int | str | None = 0
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


class _Pickled:
    """Unpickles to a call of os.getcwd: code that torch.load(weights_only=True) refuses to run."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (os.getcwd, ())


def test_every_checkpoint_that_does_not_load_is_exit_4_with_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_checkpoint(tmp_path / "good", seed=0)
    data = write_test_set(tmp_path / "data")
    common = ["--data", str(data), "--src", "en", "--tgt", "de", "--max-len-b", "4"]

    def fails(checkpoint: Path, *more: str) -> str:
        code, out, err = command_line(capsys, str(checkpoint), *common, *more)
        assert code == 4 and out == "" and len(err.splitlines()) == 1, err
        return err

    pickled = tmp_path / "pickled"
    shutil.copytree(tmp_path / "good", pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"weight": _Pickled()}, pickled / "pytorch_model.bin")
    assert fails(pickled).startswith(
        f"error: {pickled / 'pytorch_model.bin'}: torch.load refused to unpickle"
    )

    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "good", missing)
    (missing / "model.safetensors").unlink()
    assert fails(missing).startswith(f"error: {missing}: no weights beside config.json")

    unknown = tmp_path / "unknown"
    shutil.copytree(tmp_path / "good", unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    assert fails(unknown).startswith(f"error: {unknown / 'config.json'}: ")
    assert "no-such-model" in fails(unknown)

    run = tmp_path / "run"
    for step in (10, 20):
        save_checkpoint(run / f"step-{step}", seed=step)
        checkpoint_files.state_dir(run / f"step-{step}").mkdir()
        checkpoint_files.write_meta(
            run / f"step-{step}", checkpoint_files.RunShape(1, "allreduce", None), step
        )
    assert fails(run).startswith(
        f"error: {run} is a run directory (2 checkpoints, the newest step-20), not a checkpoint: pass "
        "--average-last 1"
    )
    assert command_line(capsys, str(run), *common, "--average-last", "1")[0] == 0


def test_the_split_comes_from_the_run_or_the_data_and_a_missing_one_lists_those_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_checkpoint(tmp_path / "run" / "step-2", seed=0)
    data = write_test_set(tmp_path / "data")
    common = ["--data", str(data), "--src", "en", "--tgt", "de", "--max-len-b", "4"]
    code, out, _ = command_line(capsys, str(tmp_path / "run" / "step-2"), *common)
    assert code == 0 and json.loads(out)["split"] == "test"  # the data's only test* split

    (tmp_path / "run" / "config.toml").write_text('[data]\ntest_split = "dev"\n')  # the run's, first
    code, _, err = command_line(capsys, str(tmp_path / "run" / "step-2"), *common)
    assert code == 3 and f"missing data file {data / 'dev.en'}" in err
    assert "there is no dev.* file (the splits here: test)" in err

    for name in ("test_a.en", "test_a.de"):
        shutil.copy(data / name.replace("test_a", "test"), data / name)
    code, _, err = command_line(capsys, str(tmp_path / "model-elsewhere"), *common)
    assert code == 3 and err == (
        f"error: no --split given and {data} has several test splits (test, test_a): pass --split NAME\n"
    )


def test_tokenize_score_and_the_paired_bootstrap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_test_set(tmp_path / "data")
    common = ["--data", str(data), "--src", "en", "--tgt", "de", "--split", "test"]
    perfect, worse = tmp_path / "perfect.txt", tmp_path / "worse.txt"
    perfect.write_text("".join(t + "\n" for t in TARGETS))
    worse.write_text("".join(" ".join(t.split()[:2]) + "\n" for t in TARGETS))

    code, out, err = command_line(capsys, "--score", str(perfect), *common, "--tokenize", "char")
    result = json.loads(out)
    assert code == 0 and result["bleu"] == 100.0 and result["scored"] == str(perfect)
    assert "|tok:char|" in result["bleu_signature"] and "4 sentences of" in err
    assert command_line(capsys, "--score", str(perfect), *common, "--tokenize", "nope")[0] == 2

    code, out, err = command_line(capsys, "--score", str(perfect), *common, "--compare", str(worse))
    paired = json.loads(out)["compare"]
    assert code == 0 and paired["other"] == str(worse)
    assert paired["bleu"]["this"] == 100.0 and paired["bleu"]["other"] < 100.0
    assert 0 <= paired["bleu"]["p_value"] <= 1 and "bs:1000" in paired["bleu"]["signature"]
    assert paired["chrf"]["this"] == 100.0 and "p = " in err

    worse.write_text("one line\n")
    code, _, err = command_line(capsys, "--score", str(perfect), *common, "--compare", str(worse))
    assert code == 3 and err == (
        f"error: --compare {worse} has 1 lines but the test set has 4 sentences: expected one hypothesis "
        "per line, in the test set's order (what --hypotheses writes)\n"
    )
    save_checkpoint(tmp_path / "model", seed=0)
    code, _, err = command_line(capsys, str(tmp_path / "model"), "--score", str(perfect), *common)
    assert code == 2 and "not both" in err
    assert command_line(capsys, *common)[0] == 2  # neither


def test_a_path_that_does_not_exist_is_exit_4_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_test_set(tmp_path / "data")
    code, _, err = command_line(
        capsys, str(tmp_path / "typo"), "--data", str(data), "--src", "en", "--tgt", "de"
    )
    assert code == 4 and err == (
        f"error: {tmp_path / 'typo'} does not exist: give a checkpoint directory, a run directory with "
        "--average-last K or a hub name (owner/name)\n"
    )
