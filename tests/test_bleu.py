"""eval/bleu.py on checkpoints that from_pretrained loads, built here without the recipe."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sacrebleu", reason="eval/bleu.py needs pip install '.[recipes]'")
pytest.importorskip("tokenizers", reason="eval/bleu.py needs pip install '.[recipes]'")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("eval_bleu", ROOT / "eval" / "bleu.py")
assert spec is not None and spec.loader is not None
bleu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bleu)

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


def test_bleu_of_a_checkpoint_prints_the_signature_and_writes_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_checkpoint(tmp_path / "model", seed=0)
    data = write_test_set(tmp_path / "data")
    result = bleu.main(
        [str(tmp_path / "model"), "--data", str(data), "--src", "en", "--tgt", "de", "--max-len-b", "4"]
    )
    printed = capsys.readouterr().out
    assert "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in printed and "chrF2|" in printed
    scores = json.loads((tmp_path / "model" / "test.en-de.json").read_text())
    assert scores == result and scores["beam"] == 4 and scores["length_penalty"] == 0.6
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed")
    hypotheses = (tmp_path / "model" / "test.en-de.hyp").read_text().splitlines()
    assert len(hypotheses) == len(SOURCES) == scores["sentences"]


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


def test_average_last_k_averages_the_weights_of_the_last_checkpoints(tmp_path: Path) -> None:
    models = [save_checkpoint(tmp_path / "run" / f"step-{step}", seed=step) for step in (5, 10, 20)]
    (tmp_path / "run" / "step-30").mkdir()  # no config.json: not a checkpoint
    averaged, _, used = bleu.load_model(tmp_path / "run", 2, torch.float32)
    assert [p.name for p in used] == ["step-10", "step-20"]
    expected = {
        k: (models[1].state_dict()[k] + models[2].state_dict()[k]) / 2 for k in models[2].state_dict()
    }
    for key, value in averaged.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(value, expected[key], atol=1e-6), key
    assert bleu.score(["ein Mann liest ."], ["ein Mann liest ."])["bleu"] == 100.0
