"""Character-level language-modelling data and model shared by the Accelerate and Trainer examples.

``load_text(path)`` reads a plain or gzipped text file, one sentence per line (for instance
Multi30k's ``train.en.gz``); without a path it generates a small built-in corpus so the examples run
offline. ``CharDataset`` cuts the encoded text into fixed-length blocks of token ids.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

SUBJECTS = ["A man", "A woman", "Two dogs", "A child", "Three people", "A cyclist", "An old man", "A girl"]
ACTIONS = ["is walking", "are playing", "is riding", "is sitting", "are running", "is climbing", "is looking"]
PLACES = ["on the beach", "in the park", "down the street", "near a lake", "on a bench", "in the snow"]


def load_text(path: str | None, lines: int = 4000, seed: int = 0) -> list[str]:
    """Sentences from ``path`` (``.txt`` or ``.gz``), or ``lines`` generated ones when ``path`` is None."""
    if path is None:
        rng = random.Random(seed)
        return [f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(PLACES)}." for _ in range(lines)]
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"--text {path}: no such file (give a .txt or .gz file, one sentence per line)"
        )
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt", encoding="utf-8") as handle:
        sentences = [line.strip() for line in handle if line.strip()]
    if not sentences:
        raise ValueError(f"--text {path}: the file has no text")
    return sentences


class CharDataset(Dataset[dict[str, torch.Tensor]]):
    """Blocks of ``block + 1`` character ids (inputs and shifted labels share one block)."""

    def __init__(self, sentences: list[str], vocabulary: list[str], block: int) -> None:
        index = {ch: i for i, ch in enumerate(vocabulary)}
        unknown = index["?"]
        ids = [index.get(ch, unknown) for ch in "\n".join(sentences)]
        count = len(ids) // block
        if count == 0:
            raise ValueError(f"the text has {len(ids)} characters, fewer than one block of {block}")
        self.blocks = torch.tensor(ids[: count * block]).view(count, block)  # (N, block)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def vocabulary_of(sentences: list[str]) -> list[str]:
    """Sorted characters of the text, plus newline and the '?' used for unseen characters."""
    return sorted(set("".join(sentences)) | {"\n", "?"})


def split(sentences: list[str], validation: float = 0.05) -> tuple[list[str], list[str]]:
    """The last ``validation`` fraction of sentences is held out."""
    cut = max(1, int(len(sentences) * (1 - validation)))
    return sentences[:cut], sentences[cut:]


def tiny_gpt2(vocabulary: list[str], block: int, seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer, 128-wide GPT-2 over ``vocabulary`` (about 0.4M parameters), seeded."""
    torch.manual_seed(seed)
    newline = vocabulary.index("\n")  # GPT-2's default bos/eos ids lie outside this vocabulary
    config = GPT2Config(
        vocab_size=len(vocabulary), n_positions=block, n_embd=128, n_layer=2, n_head=4,
        bos_token_id=newline, eos_token_id=newline,
    )  # fmt: skip
    return GPT2LMHeadModel(config)
