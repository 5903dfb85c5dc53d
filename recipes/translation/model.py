"""The Transformer encoder-decoder of the recipe: a Marian model built from its config, random init.

Marian is the Vaswani et al. Transformer as ``transformers`` ships it: post-norm layers, sinusoidal
positions, embeddings scaled by sqrt(d_model), one embedding matrix shared by the encoder, the
decoder and the output projection (``share_encoder_decoder_embeddings``, ``tie_word_embeddings``),
and the decoder starts from ``<pad>``. A saved checkpoint is an ordinary ``MarianMTModel``:
``AutoModelForSeq2SeqLM.from_pretrained(dir)`` loads it and ``generate`` decodes with it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def build_model(
    vocab_size: int,
    *,
    pad_id: int,
    eos_id: int,
    layers: int,
    d_model: int,
    ffn_dim: int,
    heads: int,
    dropout: float,
    attention_dropout: float = 0.0,
    activation_dropout: float = 0.0,
    max_positions: int = 1024,
    beam: int = 4,
    length_penalty: float = 0.6,
) -> Any:
    """A randomly initialised ``MarianMTModel`` with ``layers`` encoder and decoder layers, SDPA attention.

    Weights are drawn with std ``d_model ** -0.5`` (the Transformer's embedding init, and close to
    Xavier for the d_model x d_model projections). The generation config holds the recipe's decoding
    defaults (beam 4, length penalty 0.6), so ``generate`` without arguments decodes as eval does.
    """
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn_dim,
        decoder_ffn_dim=ffn_dim,
        dropout=dropout,
        attention_dropout=attention_dropout,
        activation_dropout=activation_dropout,
        activation_function="relu",
        max_position_embeddings=max_positions,
        init_std=d_model**-0.5,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        decoder_start_token_id=pad_id,
        forced_eos_token_id=eos_id,
    )
    config._attn_implementation = "sdpa"
    model = MarianMTModel(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        decoder_start_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        forced_eos_token_id=eos_id,
        num_beams=beam,
        length_penalty=length_penalty,
        max_length=max_positions,
    )
    return model


def loss_and_tokens(
    model: nn.Module, batch: dict[str, torch.Tensor], label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(label-smoothed mean loss, summed NLL, number of target tokens) of a batch.

    ``batch`` holds ``decoder_input_ids`` (see ``data.collate``), so the model computes no loss of its
    own; positions labelled -100 (padding) count in neither the loss nor the token count.
    """
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs).logits  # (B, T, V)
    labels = batch["labels"]  # (B, T)
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, label_smoothing=label_smoothing)
    nll = F.cross_entropy(flat_logits.detach(), flat_labels, ignore_index=-100, reduction="sum")
    return loss, nll, (labels != -100).sum()
