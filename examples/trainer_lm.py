"""Decentralized training with the Hugging Face Trainer: a small character-level GPT-2.

CPU-only machine, 4 processes (gloo; ``use_cpu=True`` is set below when no GPU is present)::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/trainer_lm.py \\
        --text DATA/multi30k/train.en.gz --output-dir runs/trainer_lm

or ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 examples/trainer_lm.py``.
On GPUs: ``torchrun --nproc_per_node 8 examples/trainer_lm.py --bf16 ...``. Add
``--resume`` to continue from the newest complete checkpoint in ``--output-dir``, or ``--resume auto``
to do so when there is one and start a new run when there is none (what a launcher's automatic
restart needs: ``torchrun --max-restarts=3 ... --resume auto``).

The only changes against a stock Trainer script are the ``DecentralizedTrainer`` class and its
``DecentralizedArguments``; evaluation and saved checkpoints use the consensus model, and the
training logs carry the consensus distance and the communication wait.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from char_data import CharDataset, load_text, split, tiny_gpt2, vocabulary_of
from transformers import TrainingArguments

from decentadam import SETTINGS
from decentadam.distributed import init_restartable_process_group
from decentadam.integrations.trainer import (
    DecentralizedArguments,
    DecentralizedTrainer,
    last_complete_checkpoint,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--text", help="training text, .txt or .gz, one sentence per line (default: built-in)"
    )
    parser.add_argument("--output-dir", default="runs/trainer_lm")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument(
        "--setting", help=f"DecentralizedAdam's setting: {', '.join(SETTINGS)} (docs/choosing.md)"
    )
    parser.add_argument("--topology", help="complete, ring, one-peer-exp or aer (default: the setting's)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--resume",
        nargs="?",
        choices=("auto", "must"),
        const="must",
        help="continue from the newest complete checkpoint in --output-dir: 'must' (a bare --resume) "
        "fails without one, 'auto' then starts a new run",
    )
    return parser.parse_args()


def resume_from(output_dir: str, resume: str | None) -> str | bool | None:
    """What ``train(resume_from_checkpoint=...)`` gets for ``--resume``.

    ``auto`` refuses an ``--output-dir`` that holds files but nothing a Trainer run wrote (no
    ``checkpoint-N``, no ``training_args.bin``): it is not this run's directory.
    """
    if resume == "must":
        return True  # the newest complete checkpoint-N; DecentralizedTrainer skips incomplete ones
    if resume != "auto":
        return None
    directory = Path(output_dir)
    entries = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    ours = any(re.fullmatch(r"checkpoint-\d+", name) for name in entries) or "training_args.bin" in entries
    if entries and not ours:
        raise SystemExit(
            f"--resume auto: --output-dir {directory} is not a Trainer run directory: it holds "
            f"{', '.join(entries[:5])} but no checkpoint-N and no training_args.bin. Pass a new or empty "
            "--output-dir, or the one of the run to continue."
        )
    return last_complete_checkpoint(output_dir)


def main() -> None:
    args = parse_args()
    resume = resume_from(args.output_dir, args.resume)  # before any work: a wrong directory fails now
    train_text, val_text = split(load_text(args.text))
    vocabulary = vocabulary_of(train_text)
    init_restartable_process_group()  # under torchrun --max-restarts: each attempt its own keys
    training = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=args.bf16,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=2e-3,
        adam_beta2=0.999,
        weight_decay=0.01,
        warmup_steps=30,
        lr_scheduler_type="inverse_sqrt",
        max_steps=args.steps,
        logging_steps=50,
        eval_strategy="steps",
        eval_steps=100,
        save_steps=100,
        save_total_limit=2,
        report_to=[],
        seed=0,
    )
    trainer = DecentralizedTrainer(
        model=tiny_gpt2(vocabulary, args.block),
        args=training,
        train_dataset=CharDataset(train_text, vocabulary, args.block),
        eval_dataset=CharDataset(val_text, vocabulary, args.block),
        decentralized=DecentralizedArguments(setting=args.setting, topology=args.topology),
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()  # the consensus model: GPT2LMHeadModel.from_pretrained(output_dir) loads it


if __name__ == "__main__":
    main()
