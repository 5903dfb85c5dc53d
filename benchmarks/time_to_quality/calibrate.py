"""One rank of the benchmark's calibration: the translation model's compute and optimizer steps.

``benchmarks.time_to_quality.launch`` starts this on every rank at once (the 4 processes share the
cores as they do in training), with no process group and no network::

    python -m benchmarks.time_to_quality.calibrate '{"preset": "multi30k-en-de",
        "overrides": [...], "rank": 0, "world_size": 4, "local_world_size": 2, "warmup": 3, "steps": 12,
        "out": "r0.json"}'

Each rank builds the recipe's model and reads its own batches of the recipe's data order (the same
code and settings as ``recipes.translation.train``), then times, per optimizer step, the
forward and backward passes of its micro-batches (C) and the two optimizer steps the runtime model
needs: torch AdamW after All-Reduce (U_ar) and DecentralizedAdam's step (mix, AccumAdamW, copy into
the send buffer: U_dec), the latter on a copy of the model with exchanges that finish at once.
It writes the means over ``steps`` steps after ``warmup`` and the parameter bytes S to ``out``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from decentadam import DecentralizedAdam
from decentadam.collectives import SingleProcessCommunicator
from recipes.common.optim import build_optimizer
from recipes.translation import config, data
from recipes.translation.model import build_model, loss_and_tokens


class _Offline(SingleProcessCommunicator):
    """Exchanges that finish at once, as rank ``rank`` of ``world_size``: the step without the network."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """Time ``spec['steps']`` optimizer steps after ``spec['warmup']`` on rank ``spec['rank']``."""
    from accelerate.utils import set_seed

    torch.set_num_threads(1)
    cfg = config.load(spec["preset"], spec["overrides"])
    rank, world = int(spec["rank"]), int(spec["world_size"])
    tokenizer, _, train_set, _ = data.prepare_data(cfg.data)  # the recipe's data, from its caches
    batches = data.TokenBatches(
        train_set.src_lengths,
        train_set.tgt_lengths,
        cfg.train.global_tokens // (world * cfg.train.grad_accum),
        seed=cfg.train.seed,
        rank=rank,
        world_size=world,
        multiple_of=cfg.train.grad_accum,
    ).epoch_batches(0)

    set_seed(cfg.train.seed)
    model = build_model(
        len(tokenizer),
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        **dataclasses.asdict(cfg.model),
    )
    set_seed(cfg.train.seed + 1000 * (rank + 1))
    shadow = copy.deepcopy(model)
    # the recipe's optimizers, built as it builds them; the update is what is timed (the runtime
    # model prices the exchanges), so DecentralizedAdam's exchange options keep their defaults
    o = dataclasses.replace(
        cfg.optim, setting=None, exchange=None, average_every=None, intra_node=None,
        share_second_moment_every=None, sync_steps=None, local_world_size=int(spec["local_world_size"]),
    )  # fmt: skip
    adamw = build_optimizer(model, dataclasses.replace(o, optimizer="allreduce"), world_size=world)
    ours = build_optimizer(
        shadow, dataclasses.replace(o, optimizer="decentralized"), world_size=world,
        communicator=_Offline(rank, world),
    )  # fmt: skip
    assert isinstance(ours, DecentralizedAdam)
    pairs = list(zip(model.parameters(), shadow.parameters(), strict=True))
    times: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "adamw_s": [], "decentralized_s": []}
    micro: list[dict[str, torch.Tensor]] = []
    done = 0
    model.train()
    for _, batch in data.iterate(train_set, batches, tokenizer.pad_token_id):
        micro.append(batch)
        if len(micro) < cfg.train.grad_accum:
            continue
        forward = backward = 0.0
        for micro_batch in micro:
            begin = time.perf_counter()
            loss, _, _ = loss_and_tokens(model, micro_batch, o.label_smoothing)
            middle = time.perf_counter()
            torch.autograd.backward(loss / len(micro))  # the recipe's scaling over micro-batches
            forward, backward = forward + middle - begin, backward + time.perf_counter() - middle
        micro.clear()
        begin = time.perf_counter()
        adamw.step()
        adamw_s = time.perf_counter() - begin
        for param, copied in pairs:
            copied.grad = param.grad
        begin = time.perf_counter()
        ours.step()
        decentralized_s = time.perf_counter() - begin
        adamw.zero_grad(set_to_none=True)
        done += 1
        if done > spec["warmup"]:
            for key, value in zip(times, (forward, backward, adamw_s, decentralized_s), strict=True):
                times[key].append(value)
        if done == spec["warmup"] + spec["steps"]:
            break
    else:
        raise RuntimeError(f"rank {rank}: the first epoch has only {done} steps; lower the steps")
    ours.close()
    means = {key: statistics.mean(values) for key, values in times.items()}
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {
        "rank": rank,
        "params": params,
        "param_bytes": param_bytes,
        "test": {"split": cfg.data.test_split, "src": cfg.data.src, "tgt": cfg.data.tgt},
        "compute_s": means["forward_s"] + means["backward_s"],
        **means,
        "per_step": times,
    }


def main() -> int:
    spec = json.loads(sys.argv[1])
    result = calibrate(spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
