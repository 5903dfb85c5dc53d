"""Decentralized training with the Hugging Face Trainer: a small character-level GPT-2.

CPU-only machine, 4 processes (gloo; ``use_cpu=True`` is set below when no GPU is present)::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/trainer_lm.py \\
        --text DATA/multi30k/train.en.gz --output-dir runs/trainer_lm

or ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 examples/trainer_lm.py``.
On GPUs: ``torchrun --nproc_per_node 8 examples/trainer_lm.py --bf16 ...``. Add
``--resume`` to continue from the newest complete checkpoint in ``--output-dir``.

The only changes against a stock Trainer script are the ``DecentralizedTrainer`` class and its
``DecentralizedArguments``; evaluation and saved checkpoints use the consensus model, and the
training logs carry the consensus distance and the communication wait.
"""

from __future__ import annotations

import argparse

import torch
from char_data import CharDataset, load_text, split, tiny_gpt2, vocabulary_of
from transformers import TrainingArguments

from decentadam.integrations.trainer import DecentralizedArguments, DecentralizedTrainer


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
    parser.add_argument("--topology", default="aer")
    parser.add_argument("--second-moment", choices=("all_ranks", "local"), default="all_ranks")
    parser.add_argument("--accum-steps", type=int, default=1, help="AccumAdam window s (second moment local)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    train_text, val_text = split(load_text(args.text))
    vocabulary = vocabulary_of(train_text)
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
        decentralized=DecentralizedArguments(
            topology=args.topology, second_moment=args.second_moment, accum_steps=args.accum_steps
        ),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model()  # the consensus model: GPT2LMHeadModel.from_pretrained(output_dir) loads it


if __name__ == "__main__":
    main()
