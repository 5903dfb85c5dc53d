"""decentadam-export (recipes/export.py): a run's checkpoint as a from_pretrained directory with a model
card whose numbers are the run's, pushed to a mocked hub; bad input refused in one line, leaving no OUT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

pytest.importorskip("sacrebleu", reason="eval.bleu needs pip install '.[recipes]'")
pytest.importorskip("huggingface_hub", reason="the model card needs huggingface_hub (with transformers)")
from decentadam import checkpoint_files
from decentadam.checkpoint import save_checkpoint
from eval import bleu
from recipes import export
from tests.test_bleu import save_checkpoint as save_pretrained_marian
from tests.test_bleu import write_test_set

yaml = pytest.importorskip("yaml", reason="reading the card's front matter needs PyYAML (with transformers)")

CONFIG = """[data]
path = "{data}"
src = "en"
tgt = "de"
train_split = "train"
val_split = "val"
test_split = "test"

[optim]
optimizer = "decentralized"
lr = 0.002
betas_decentralized = [0.9, 0.98]
topology = "aer"
second_moment = "all_ranks"
local_world_size = 2

[train]
max_steps = 4
"""


def train_and_save(
    checkpoint: Path, model: Any, processor: Any, inputs: dict[str, torch.Tensor], step: int
) -> None:
    """One AdamW step of ``model`` on ``inputs``, then decentadam's checkpoint (one process: an All-Reduce
    shape, every rank's state file and meta.json), as a recipe writes it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    extra = {"step": step, "epoch": 1, "train_seconds": 1.5 * step}
    save_checkpoint(checkpoint, model, optimizer, extra=extra, processor=processor)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A translation run directory: step-2 and step-4 trained from a tiny Marian model, config.toml,
    metrics.jsonl (step-4's line with a train_loss) and decentadam-bleu's JSON of step-4."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    base = tmp_path_factory.mktemp("translation")
    save_pretrained_marian(base / "init", seed=0)
    model = AutoModelForSeq2SeqLM.from_pretrained(base / "init")
    tokenizer = AutoTokenizer.from_pretrained(base / "init")
    inputs = dict(
        tokenizer(["a small dog runs ."], text_target=["ein kleiner Hund rennt ."], return_tensors="pt")
    )
    data = write_test_set(base / "data")
    run = base / "run"
    for step in (2, 4):
        train_and_save(run / f"step-{step}", model, tokenizer, inputs, step)
    (run / "config.toml").write_text(CONFIG.format(data=data))
    lines = [
        {"step": 2, "train_seconds": 3.0, "valid_nll": 5.123456, "epoch": 1},
        {"step": 4, "train_seconds": 6.25, "valid_nll": 4.0419462528466189, "epoch": 1, "train_loss": 4.75},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    for step in (2, 4):  # what `decentadam-bleu RUN/step-N ... --output` writes
        result = bleu.evaluate(run / f"step-{step}", str(data), "test", "en", "de", max_len_b=4)
        (run / f"test-step{step}.json").write_text(json.dumps(result, indent=1) + "\n")
    return run


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int | str | None, str, str]:
    """``decentadam-export ARGS`` in this process: exit code (0 when it exported), stdout, stderr."""
    capsys.readouterr()
    try:
        export.main([str(a) for a in args])
        code: int | str | None = 0
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


def front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    matter: dict[str, Any] = yaml.safe_load(card.split("---\n")[1])
    return matter


def metric(matter: dict[str, Any], kind: str) -> dict[str, Any]:
    for result in matter["model-index"][0]["results"]:
        for found in result["metrics"]:
            if found["type"] == kind:
                return {**found, "split": result["dataset"]["split"]}
    raise AssertionError(f"no {kind} in the model-index")


def test_a_run_exports_its_newest_checkpoint_with_a_card_whose_numbers_are_the_runs(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    out = tmp_path / "exported" / "tiny-en-de"
    code, stdout, err = main(capsys, run, out)
    assert code == 0, err
    assert stdout == f"exported {run / 'step-4'} to {out}\n"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    assert not list(out.parent.glob(".*"))  # no staging directory left beside it
    assert (out / "model.safetensors").read_bytes() == (run / "step-4" / "model.safetensors").read_bytes()
    loaded = AutoModelForSeq2SeqLM.from_pretrained(out).state_dict()
    for key, value in AutoModelForSeq2SeqLM.from_pretrained(run / "step-4").state_dict().items():
        assert torch.equal(loaded[key], value), key
    assert AutoTokenizer.from_pretrained(out)("a man reads .")["input_ids"]

    card = (out / "README.md").read_text()
    scores = json.loads((run / "test-step4.json").read_text())
    matter = front_matter(card)
    assert matter["library_name"] == "transformers" and matter["pipeline_tag"] == "translation"
    assert {"decentadam", "translation", "marian"} <= set(matter["tags"]) and matter["language"] == [
        "en",
        "de",
    ]
    bleu_entry = metric(matter, "bleu")
    assert bleu_entry["value"] == scores["bleu"] and bleu_entry["split"] == "test"
    assert metric(matter, "chrf")["value"] == scores["chrf"]
    assert metric(matter, "valid_nll")["value"] == 4.0419462528466189
    assert metric(matter, "train_loss")["value"] == 4.75
    assert f"| BLEU | {scores['bleu']:.4g} | test of `{scores['data']}` | `test-step4.json`, " in card
    for signature in (scores["bleu_signature"], scores["chrf_signature"]):  # pipes escaped in a table
        assert "`{}`".format(signature.replace("|", "\\|")) in card
    assert "| validation NLL (valid_nll) | 4.042 | val, step 4 | `metrics.jsonl` |" in card
    assert "| training loss (train_loss) | 4.75 | training, step 4 | `metrics.jsonl` |" in card
    assert "- Run: 1 ranks, topology `allreduce`; 4 optimizer steps, 6.0 s of training" in card
    assert '| `topology` | `"aer"` |' in card and "| `lr` | `0.002` |" in card
    assert "languages en → de" in card and "test-step2.json" not in card  # step-2's score is not this one's
    assert f"AutoModelForSeq2SeqLM.from_pretrained({str(out)!r})" in card
    assert f"decentadam-bleu {run / 'step-4'} --data {scores['data']} --split test --src en --tgt de" in card
    assert f"decentadam-export {run} {out}\n" in card


def test_average_last_exports_the_mean_and_the_card_says_how_to_score_it(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForSeq2SeqLM

    out = tmp_path / "avg"
    code, _, err = main(capsys, run, out, "--average-last", "2")
    assert code == 0, err
    assert not (out / "decentadam").exists() and (out / "model.safetensors").is_file()
    two, four = (AutoModelForSeq2SeqLM.from_pretrained(run / f"step-{s}").state_dict() for s in (2, 4))
    for key, value in AutoModelForSeq2SeqLM.from_pretrained(out).state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(value, (two[key] + four[key]) / 2, atol=1e-6), key
    card = (out / "README.md").read_text()
    assert "the mean of 2 checkpoints" in card and "step-2, step-4" in card
    assert "No BLEU and chrF of these weights is recorded" in card  # the step-4 JSON is not the average's
    assert f"decentadam-bleu {run} --average-last 2 --data " in card
    assert "bleu" not in json.dumps(front_matter(card).get("model-index", []))

    code, _, err = main(capsys, run, tmp_path / "three", "--average-last", "3")
    assert code == 2 and err == (
        f"error: --average-last 3: {run} holds 2 complete checkpoints (step-2, step-4); pass "
        "--average-last 2 or fewer\n"
    )


def test_eval_given_must_score_the_exported_weights(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = main(capsys, run / "step-2", tmp_path / "a", "--eval", run / "test-step2.json")
    assert code == 0, err
    card = (tmp_path / "a" / "README.md").read_text()
    assert (
        metric(front_matter(card), "bleu")["value"]
        == json.loads((run / "test-step2.json").read_text())["bleu"]
    )
    assert "| validation NLL (valid_nll) | 5.123 | val, step 2 |" in card and "train_loss" not in card

    code, out, err = main(capsys, run, tmp_path / "b", "--eval", run / "test-step2.json")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(
        f"error: --eval {run / 'test-step2.json'} scored {run / 'step-2'}, not the exported"
    )
    (tmp_path / "other.json").write_text('{"step": 4}')
    code, _, err = main(capsys, run, tmp_path / "b", "--eval", tmp_path / "other.json")
    assert code == 3 and "is not what decentadam-bleu or decentadam-accuracy writes" in err
    assert not (tmp_path / "b").exists()


def test_eval_json_written_from_another_directory_is_found_by_run_and_step(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    (run / "step-4").mkdir(parents=True)
    result = {"bleu": 1.0, "bleu_signature": "s", "checkpoints": ["runs/demo/step-4"]}
    (run / "mine.json").write_text(json.dumps(result))
    (run / "other.json").write_text(json.dumps({**result, "checkpoints": ["runs/other/step-4"]}))
    (run / "notes.json").write_text("[1, 2]")
    assert [f.name for f, _ in export.find_evals(run, [run / "step-4"])] == ["mine.json"]


class FakeHub:
    """huggingface_hub.HfApi's two calls that push uses, recorded; ``refuse`` raises instead."""

    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    refuse: ClassVar[Exception | None] = None

    def create_repo(self, repo_id: str, **options: Any) -> str:
        if self.refuse is not None:
            raise self.refuse
        self.calls.append(("create_repo", {"repo_id": repo_id, **options}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **options: Any) -> None:
        files = sorted(p.name for p in Path(options["folder_path"]).iterdir())
        self.calls.append(("upload_folder", {**options, "files": files}))


def test_push_to_hub_creates_the_repository_and_uploads_the_exported_folder(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalTokenNotFoundError

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    monkeypatch.setattr(FakeHub, "calls", [])
    out = tmp_path / "pushed"
    code, stdout, err = main(capsys, run, out, "--push-to-hub", "me/tiny-en-de", "--private")
    assert code == 0, err
    assert stdout.splitlines()[-1] == "pushed to https://huggingface.co/me/tiny-en-de"
    assert FakeHub.calls == [
        ("create_repo", {"repo_id": "me/tiny-en-de", "private": True, "exist_ok": True}),
        ("upload_folder", {
            "folder_path": str(out), "repo_id": "me/tiny-en-de",
            "commit_message": "Upload with decentadam-export", "files": sorted(p.name for p in out.iterdir()),
        }),
    ]  # fmt: skip
    assert (
        "model.safetensors" in FakeHub.calls[1][1]["files"]
        and "decentadam" not in FakeHub.calls[1][1]["files"]
    )
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "\n# me/tiny-en-de\n" in card
    assert "AutoModelForSeq2SeqLM.from_pretrained('me/tiny-en-de')" in card
    assert "--push-to-hub me/tiny-en-de --private" in card

    monkeypatch.setattr(
        FakeHub, "refuse", LocalTokenNotFoundError("Token is required but no token was found.")
    )
    code, stdout, err = main(capsys, run, out, "--overwrite", "--push-to-hub", "me/tiny-en-de")
    assert code == 6 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --push-to-hub me/tiny-en-de: LocalTokenNotFoundError: Token is required")
    assert "hf auth login" in err and (out / "model.safetensors").is_file()  # the export itself is kept

    code, _, err = main(capsys, run, tmp_path / "x", "--private")
    assert (
        code == 2
        and err
        == "error: --private makes the hub repository private: it goes with --push-to-hub OWNER/NAME\n"
    )
    code, _, err = main(capsys, run, tmp_path / "x", "--push-to-hub", "no-owner")
    assert code == 2 and "expected OWNER/NAME" in err and not (tmp_path / "x").exists()


def test_bad_input_is_one_line_with_the_exit_code_and_leaves_no_out(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"

    def fails(code: int, *args: Any) -> str:
        got, stdout, err = main(capsys, *args)
        assert got == code and stdout == "" and len(err.splitlines()) == 1, (got, err)
        assert not out.exists() or (out / "keep.txt").is_file()
        return err

    assert fails(4, tmp_path / "nowhere", out) == (
        f"error: {tmp_path / 'nowhere'} does not exist: give a recipe's run directory or one of its step-N "
        "checkpoints\n"
    )
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    assert fails(4, tmp_path / "notes", out).startswith(
        f"error: {tmp_path / 'notes'} holds no complete checkpoint"
    )
    plain = tmp_path / "plain"
    save_pretrained_marian(plain, seed=1)  # from_pretrained loads it, but it is no decentadam checkpoint
    assert fails(4, plain, out).startswith(f"error: {plain / 'decentadam' / 'meta.json'} does not exist")
    broken = tmp_path / "broken" / "step-4"
    shutil.copytree(run / "step-4", broken)
    (broken / "model.safetensors").unlink()
    assert fails(4, broken, out).startswith(f"error: {broken}: no weights beside config.json")

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert fails(6, run, out) == (
        f"error: {out} is not empty (keep.txt): pass --overwrite to replace it, or give a new directory\n"
    )
    assert fails(6, run, run / "step-4" / "..", "--overwrite").startswith("error: ")  # would replace the run
    assert (run / "step-4" / "model.safetensors").is_file()

    def broken_card(*_: Any) -> str:
        raise RuntimeError("the card failed")

    monkeypatch.setattr(export, "model_card", broken_card)
    with pytest.raises(RuntimeError, match="the card failed"):  # a bug: its traceback, exit code 1
        export.main([str(run), str(out), "--overwrite"])
    assert (out / "keep.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert not list(tmp_path.glob(".out.*"))  # the staging directory is gone
    shutil.rmtree(out)
    with pytest.raises(RuntimeError):
        export.main([str(run), str(out)])
    assert not out.exists() and not list(tmp_path.glob(".out.*"))

    monkeypatch.setattr(export, "model_card", lambda *_: (_ for _ in ()).throw(OSError(28, "No space left")))
    got, _, err = main(capsys, run, out)
    assert got == 6 and err.startswith(f"error: {out}: cannot write it (") and not out.exists()


def test_an_image_classifier_exports_with_its_processor_and_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from eval import accuracy
    from recipes.imagenet.data import image_processor
    from recipes.imagenet.model import build_model

    classes = ["cat", "dog", "fox"]
    rng = np.random.default_rng(0)
    for name in classes:
        (tmp_path / "data" / "val" / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(
                tmp_path / "data" / "val" / name / f"{i}.png"
            )
    torch.manual_seed(0)
    model = build_model("resnet-small", classes, embedding_size=8, hidden_sizes=(8, 8, 8, 8))
    processor = image_processor(16, 1.0, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    run = tmp_path / "run"
    inputs = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([0, 2])}
    train_and_save(run / "step-3", model, processor, inputs, 3)
    checkpoint_files.write_meta(  # the recorded shape of a 4-rank decentralized run, as its meta.json says
        run / "step-3",
        checkpoint_files.RunShape(4, "aer", 2),
        3,
        checkpoint_files.read_meta(run / "step-3")["extra"],
    )
    (run / "config.toml").write_text(
        '[data]\npath = "DIGITS"\nval_split = "val"\n\n[optim]\noptimizer = "decentralized"\n'
    )
    line = {"step": 3, "epochs": 0.5, "train_seconds": 2.0, "top1": 0.25, "top5": 0.75, "loss": 1.5}
    (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    scores = accuracy.evaluate(str(run / "step-3"), str(tmp_path / "data"), "val")
    (run / "val.json").write_text(json.dumps(scores))

    out = tmp_path / "resnet"
    code, _, err = main(capsys, run, out)
    assert code == 0, err
    assert (
        "decentadam" not in {p.name for p in out.iterdir()} and (out / "preprocessor_config.json").is_file()
    )
    assert type(AutoImageProcessor.from_pretrained(out)).__name__ == type(processor).__name__
    loaded = AutoModelForImageClassification.from_pretrained(out)
    assert loaded.config.id2label == {0: "cat", 1: "dog", 2: "fox"}
    card = (out / "README.md").read_text()
    matter = front_matter(card)
    assert matter["pipeline_tag"] == "image-classification" and "language" not in matter
    assert metric(matter, "accuracy")["value"] == scores["top1"] and metric(matter, "top1")["value"] == 0.25
    assert (
        f"| top-1 accuracy | {100 * scores['top1']:.2f}% | val of `{tmp_path / 'data'}` (6 images) "
        "| `val.json` |" in card
    )
    assert "| validation top-1 | 25.00% | val, step 3 | `metrics.jsonl` |" in card
    assert "- Run: 4 ranks, topology `aer`, local world size 2 (2 nodes x 2); 3 optimizer steps" in card
    assert "AutoModelForImageClassification.from_pretrained(" in card
    assert f"decentadam-accuracy {run / 'step-3'} --data {tmp_path / 'data'} --split val --output" in card
