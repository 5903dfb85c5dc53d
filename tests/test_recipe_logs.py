"""What a recipe run tells its user: a one-process decentralized run says what it trains (issue 46)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the recipes need pip install '.[recipes]'")
pytest.importorskip("tokenizers", reason="the translation recipe needs pip install '.[recipes]'")
pytest.importorskip("tensorboard", reason="the recipes log to TensorBoard")

from recipes.common import optim
from recipes.common.loop import one_process_note
from recipes.translation import synthetic
from recipes.translation import train as text_train

TINY = [
    "--preset", "demo-synthetic-en-de", "data.vocab_size=200", "model.layers=1", "model.d_model=16",
    "model.ffn_dim=32", "model.heads=2", "train.global_tokens=512", "train.mixed_precision=no",
    "train.max_steps=2", "train.log_every=1", "train.eval_every=2", "train.save_every=2", "data.val_limit=8",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.write(tmp_path_factory.mktemp("corpus"), train=200, val=16, test=4)


def tiny(corpus: Path, run: Path, *args: str) -> list[str]:
    return [
        *TINY,
        f"data={corpus}",
        f"data.cache_dir={run.parent / 'cache'}",
        f"train.output_dir={run}",
        *args,
    ]


def test_a_decentralized_run_on_one_process_says_once_that_it_is_plain_adam(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text_train.main(tiny(corpus, tmp_path / "run", "--optimizer", "decentralized"))
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert output.count("one process: --optimizer decentralized has no other rank to average with") == 1
    assert "plain Adam (AccumAdam with s = 1)" in output
    assert "accelerate launch --multi_gpu --num_processes N -m recipes.translation.train" in output
    assert "torchrun --nproc-per-node N -m recipes.translation.train" in output

    text_train.main(tiny(corpus, tmp_path / "baseline", "--optimizer", "allreduce"))
    assert "one process" not in "".join(capsys.readouterr())


def test_the_note_names_the_local_optimizer_and_is_absent_on_several_processes() -> None:
    def settings(**changes: object) -> optim.OptimConfig:
        return optim.resolved(optim.OptimConfig(**changes))  # type: ignore[arg-type]

    accum = one_process_note("recipes.imagenet.train", settings(optimizer="decentralized", accum_steps=4), 1)
    assert accum is not None and "plain AccumAdam (consensus distance 0)" in accum
    sgd = one_process_note("recipes.imagenet.train", settings(optimizer="a2cid2", algorithm="sgd"), 1)
    assert sgd is not None and "plain SGD with momentum" in sgd
    assert one_process_note("m", settings(optimizer="decentralized"), 2) is None
    assert one_process_note("m", settings(optimizer="allreduce"), 1) is None
