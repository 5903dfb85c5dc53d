"""n workers of the translation recipe in one process: how the gap to All-Reduce grows with n.

At a fixed global batch, every worker added shrinks each worker's batch. This trains the recipe's
model on the recipe's data with ``--workers`` simulated ranks on one CPU process: All-Reduce
(AdamW on the mean of the ranks' gradients, each taken on its own ``1/n`` share of the batch with
its own dropout stream, as DDP computes it) or ``DecentralizedAdam`` with the library's own update
and mixing code, one optimizer per rank exchanging through :class:`decentadam.simulation.SimulatedCluster`.
At n = 4 it reproduces a 4-process run of ``recipes.translation.train`` (same batches, seeds and
schedule; ``--check-against`` compares the first steps' losses with such a run's TensorBoard log).
The validation loss is that of the exact average of the ranks' weights, as the recipe's::

    python -m benchmarks.parity.workers --preset multi30k-en-de --data MULTI30K --workers 16 \\
        --steps 400 --optimizer decentralized --out runs/workers/dec-16.json optim.lr=2e-3

``--bleu`` scores the final exact average on the preset's test split with ``eval.bleu``'s beam search
(its decoding defaults: beam 4, length penalty 0.6) and sacreBLEU, as the recipe's BLEU command
scores a checkpoint. ``--diagnose`` (All-Reduce only) also keeps every rank's shadow Adam
moments, from its own gradient, and every ``--diagnose-every`` steps logs per parameter group how
the per-rank normalisation changes All-Reduce's step (H1: its length, H2: its direction).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from decentadam import Comm, DecentralizedAdam, make_setting
from decentadam.options import FLAT_OPTIONS
from decentadam.simulation import SimulatedCluster
from recipes.common.optim import OptimConfig, build_optimizer, decentralized_setting, param_groups
from recipes.translation import config, data
from recipes.translation.model import build_model, loss_and_tokens

GROUPS = ("embeddings", "attention", "ffn", "norms")


def group_of(name: str) -> str:
    """The parameter group of the diagnosis: embeddings (tied with the output), attention, FFN, norms."""
    if "shared" in name or "embed" in name:
        return "embeddings"
    if "layer_norm" in name:
        return "norms"
    return "attention" if "attn" in name else "ffn"


class Workers:
    """The recipe's data and n copies of its model, one per simulated rank, with per-rank streams."""

    def __init__(self, cfg: config.Config, workers: int, device: str = "cpu") -> None:
        d, t = cfg.data, cfg.train
        self.device = torch.device(device)
        self.tokenizer, _, self.train_set, self.val_set = data.prepare_data(d)  # the recipe's data
        self.pad_id = self.tokenizer.pad_token_id
        max_tokens = t.global_tokens // (workers * t.grad_accum)
        self.batches = [
            data.TokenBatches(
                self.train_set.src_lengths,
                self.train_set.tgt_lengths,
                max_tokens,
                seed=t.seed,
                rank=rank,
                world_size=workers,
                multiple_of=t.grad_accum,
            )
            for rank in range(workers)
        ]
        # every rank's share of the validation set, as the recipe sums them
        self.val_batches = [
            b
            for rank in range(workers)
            for b in data.TokenBatches(
                self.val_set.src_lengths, self.val_set.tgt_lengths, t.val_tokens,
                rank=rank, world_size=workers, shuffle=False,
            ).epoch_batches(0)
        ]  # fmt: skip
        self.cfg, self.workers = cfg, workers
        self.position = [(0, 0)] * workers  # (epoch, batch) of each rank
        self.models = [self.new_model() for _ in range(workers)]  # the same weights: one seed
        self.rng: list[tuple[Tensor, Tensor | None]] = []
        for rank in range(workers):  # the recipe's per-rank dropout streams
            torch.manual_seed(t.seed + 1000 * (rank + 1))
            self.rng.append(self.rng_state())

    def rng_state(self) -> tuple[Tensor, Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def set_rng_state(self, state: tuple[Tensor, Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def new_model(self) -> nn.Module:
        torch.manual_seed(self.cfg.train.seed)
        tokenizer = self.tokenizer
        model: nn.Module = build_model(
            len(tokenizer),
            pad_id=self.pad_id,
            eos_id=tokenizer.eos_token_id,
            **dataclasses.asdict(self.cfg.model),
        )
        return model.to(self.device)

    def next_batch(self, rank: int) -> dict[str, Tensor]:
        epoch, index = self.position[rank]
        batches = self.batches[rank].epoch_batches(epoch)
        if index >= len(batches):
            epoch, index = epoch + 1, 0
            batches = self.batches[rank].epoch_batches(epoch)
        self.position[rank] = (epoch, index + 1)
        batch = data.collate(self.train_set, batches[index], self.pad_id)
        return {key: value.to(self.device) for key, value in batch.items()}

    def backward(self, rank: int, model: nn.Module, scale: float = 1.0) -> float:
        """Rank ``rank``'s loss on its next batch, backpropagated into ``model`` (times ``scale``)."""
        self.set_rng_state(self.rng[rank])
        loss, _, _ = loss_and_tokens(model, self.next_batch(rank), self.cfg.optim.label_smoothing)
        (loss * scale).backward()  # type: ignore[no-untyped-call]
        self.rng[rank] = self.rng_state()
        return float(loss.detach())

    @torch.no_grad()
    def val_nll(self, model: nn.Module) -> float:
        model.eval()
        nll = tokens = 0.0
        for _, cpu_batch in data.iterate(self.val_set, self.val_batches, self.pad_id):
            batch = {key: value.to(self.device) for key, value in cpu_batch.items()}
            _, total, count = loss_and_tokens(model, batch, 0.0)
            nll, tokens = nll + float(total), tokens + float(count)
        model.train()
        return nll / tokens


def schedule(warmup_steps: int) -> Any:
    """The recipe's learning-rate factor: linear warm-up, then 1 / sqrt(step)."""
    warmup = max(warmup_steps, 1)
    return lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))


class Diagnosis:
    """Shadow per-rank Adam moments inside an All-Reduce run (H1: step length, H2: direction)."""

    def __init__(self, model: nn.Module, workers: int, betas: tuple[float, float], eps: float) -> None:
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.m = [torch.zeros((workers, *p.shape), device=p.device) for _, p in self.params]
        self.v = [torch.zeros((workers, *p.shape), device=p.device) for _, p in self.params]
        self.betas, self.eps, self.records = betas, eps, []  # type: ignore[var-annotated]

    def add(self, rank: int, grads: list[Tensor]) -> None:
        beta1, beta2 = self.betas
        for m, v, g in zip(self.m, self.v, grads, strict=True):
            m[rank].lerp_(g, 1 - beta1)
            v[rank].mul_(beta2).addcmul_(g, g, value=1 - beta2)

    def record(self, step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Per group: |mean_i(m_i/sqrt v_i)| / |m/sqrt v|, |m/sqrt(mean_i v_i)| / |m/sqrt v|, the cosine
        of mean_i(m_i/sqrt v_i) with m/sqrt v, and the median of mean_i v_i / v (m, v: All-Reduce's)."""
        beta1, beta2 = self.betas
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        parts: dict[str, dict[str, list[Tensor]]] = {
            g: {k: [] for k in ("ref", "local", "v_bar", "ratio")} for g in GROUPS
        }
        for (name, p), m_i, v_i in zip(self.params, self.m, self.v, strict=True):
            state = optimizer.state[p]
            m, v = state["exp_avg"] / bc1, state["exp_avg_sq"] / bc2
            v_bar = v_i.mean(0) / bc2
            values = {
                "ref": m / (v.sqrt() + self.eps),
                "local": (m_i / bc1 / ((v_i / bc2).sqrt() + self.eps)).mean(0),
                "v_bar": m / (v_bar.sqrt() + self.eps),
                "ratio": v_bar / v,
            }
            for key, value in values.items():
                parts[group_of(name)][key].append(value.reshape(-1))
        record: dict[str, Any] = {"step": step}
        for group, lists in parts.items():
            ref, local, with_v_bar = (torch.cat(lists[k]) for k in ("ref", "local", "v_bar"))
            record[group] = {
                "length_local": float(local.norm() / ref.norm()),
                "length_mean_v": float(with_v_bar.norm() / ref.norm()),
                "cosine_local": float(nn.functional.cosine_similarity(local, ref, dim=0)),
                "median_v_ratio": float(torch.cat(lists["ratio"]).nan_to_num(nan=1.0).median()),
            }
        self.records.append(record)
        return record


def node_size(local_world_size: int, workers: int, node_sums: bool) -> int:
    """Ranks per simulated node: ``optim.local_world_size`` where there are at least two such nodes
    (one node, or nodes that do not divide the workers, with ``intra_node="all_reduce"`` too), else
    one rank each."""
    if not local_world_size or workers % local_world_size:
        if node_sums and local_world_size:
            raise SystemExit(
                f"optim.intra_node=all_reduce: {workers} workers are not nodes of optim.local_world_size = "
                f"{local_world_size}; choose a worker count it divides"
            )
        return 1
    if workers // local_world_size >= 2 or node_sums:
        return local_world_size
    return 1


def setting_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of a Setting among ``options`` (``local_world_size`` is the layout's, not its)."""
    unknown = set(options) - {*FLAT_OPTIONS, "local_world_size"}
    if unknown:
        raise ValueError(f"not options of DecentralizedAdam's setting: {', '.join(sorted(unknown))}")
    return {name: value for name, value in options.items() if name in FLAT_OPTIONS}


def load_class(path: str) -> type[DecentralizedAdam]:
    """``module.Class`` (a probe's subclass of DecentralizedAdam), imported."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise SystemExit(f"--optimizer-class {path!r}: cannot import it ({error})") from None
    if not (isinstance(found, type) and issubclass(found, DecentralizedAdam)):
        raise SystemExit(f"--optimizer-class {path!r} is not a subclass of DecentralizedAdam")
    return found


def train(
    args: argparse.Namespace,
    cfg: config.Config,
    options: dict[str, Any] | None = None,
    communicator: Callable[[int, Any], Any] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train ``args.workers`` simulated ranks; returns the curve, the training losses and, for the
    decentralized optimizer, the ranks' exchange counters (``stats``).

    ``options`` replace the setting read from ``cfg.optim`` (flat, as ``[optim]`` names them:
    ``topology``, ``second_moment``, ``exchange``..., and ``local_world_size``; ``{}``: the default
    setting); ``communicator(rank, simulated)`` may wrap each rank's simulated communicator (to count
    what it sends); ``on_step(t)`` is called before the ranks' step ``t`` (1-based)."""
    world = Workers(cfg, args.workers, args.device)
    optimizer_class = load_class(args.optimizer_class)
    o = cfg.optim
    decentralized = o.optimizer == "decentralized"
    models = world.models if decentralized else world.models[:1]
    cluster = SimulatedCluster(args.workers)
    optimizers: list[Any] = []
    if decentralized:  # options: flat as the recipe's [optim] holds them, with local_world_size
        given = options or {}
        setting = decentralized_setting(o) if options is None else make_setting(**setting_options(given))
        # the ranks of a node average their gradients first
        nodes_of = node_size(o.local_world_size, args.workers, setting.intra_node == "all_reduce")
        local_world_size = given.get("local_world_size", nodes_of)
        if setting.sync_steps:  # steps that wait for their own exchange: every rank steps in a thread
            cluster = SimulatedCluster(args.workers, concurrent=True)
    for rank, model in enumerate(models):
        model.train()
        if decentralized:
            simulated = cluster.communicator(rank)
            comm = Comm(
                local_world_size=local_world_size,
                communicator=communicator(rank, simulated) if communicator else simulated,
            )
            optimizers.append(
                optimizer_class(
                    param_groups(model, o.weight_decay),
                    lr=o.lr,
                    betas=o.betas_decentralized,
                    eps=o.eps,
                    weight_decay=o.weight_decay,
                    setting=setting,
                    comm=comm,
                )
            )
        else:  # AdamW, as the recipe builds it
            baseline = OptimConfig(
                optimizer="allreduce", lr=o.lr, weight_decay=o.weight_decay, eps=o.eps,
                betas_allreduce=o.betas_allreduce,
            )  # fmt: skip
            optimizers.append(build_optimizer(model, baseline))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, schedule(o.warmup_steps)) for opt in optimizers]
    diagnosis = Diagnosis(models[0], args.workers, o.betas_allreduce, o.eps) if args.diagnose else None
    evaluator = world.new_model()
    curve, losses, begin = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        if on_step is not None:
            on_step(step)
        step_losses = []
        if decentralized:
            for rank, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
                opt.zero_grad(set_to_none=True)
                step_losses.append(world.backward(rank, model))
            for opt in optimizers:  # intra_node="all_reduce": every node's sum starts before any
                opt.start_gradient_sums()  # rank waits for its own (a no-op otherwise)
            if cluster.concurrent:
                cluster.run([opt.step for opt in optimizers])
            else:
                for opt in optimizers:  # lock step, in rank order
                    opt.step()
        else:
            model = models[0]
            params = [p for p in model.parameters() if p.requires_grad]
            total = [torch.zeros_like(p) for p in params]
            for rank in range(args.workers):  # each rank's gradient on its share; DDP averages them
                optimizers[0].zero_grad(set_to_none=True)
                step_losses.append(world.backward(rank, model))
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                if diagnosis is not None:
                    diagnosis.add(rank, grads)
                torch._foreach_add_(total, grads)
            for p, g in zip(params, total, strict=True):
                p.grad = g.div_(args.workers)
            optimizers[0].step()
            if diagnosis is not None and step % args.diagnose_every == 0:
                print(json.dumps(diagnosis.record(step, optimizers[0])), flush=True)
        for scheduler in schedulers:
            scheduler.step()
        losses.append(sum(step_losses) / len(step_losses))
        if step % args.eval_every == 0 or step == args.steps:
            per_rank = [list(m.parameters()) for m in models]
            with torch.no_grad():
                for target, mean in zip(
                    evaluator.parameters(), SimulatedCluster.average(per_rank), strict=True
                ):
                    target.copy_(mean)
            point = {
                "step": step,
                "valid_nll": world.val_nll(evaluator),
                "consensus_distance_rel": SimulatedCluster.consensus_distance(per_rank, relative=True),
                "seconds": time.perf_counter() - begin,
            }
            curve.append(point)
            print(json.dumps(point), flush=True)
    scores = test_bleu(world, evaluator, cfg) if args.bleu else None
    if scores is not None:
        print(json.dumps({"bleu": scores["bleu"], "chrf": scores["chrf"]}), flush=True)
    return {
        "curve": curve,
        "train_loss": losses,
        "stats": [dataclasses.asdict(opt.stats) for opt in optimizers] if decentralized else [],
        "parameter_count": sum(p.numel() for p in models[0].parameters() if p.requires_grad),
        "diagnosis": diagnosis.records if diagnosis else [],
        "test": scores,
    }


def test_bleu(world: Workers, model: nn.Module, cfg: config.Config) -> dict[str, Any]:
    """BLEU and chrF of ``model`` on the preset's test split, decoded as ``eval.bleu`` decodes."""
    from eval.bleu import score, translate

    d = cfg.data
    sources, references = data.read_split(d.path, d.test_split, d.src, d.tgt)
    model.eval()
    hypotheses = translate(model, world.tokenizer, sources, device=str(world.device))  # eval.bleu's defaults
    model.train()
    return {"split": d.test_split, "sentences": len(sources), **score(hypotheses, references)}


def compare_with_run(result: dict[str, Any], run: Path) -> dict[str, Any]:
    """The first steps' mean training losses against a recipe run logged with ``train.log_every=1``."""
    from benchmarks.parity.oracle import train_losses

    logged = train_losses(run)
    steps = sorted(s for s in logged if s <= len(result["train_loss"]))
    differences = [abs(result["train_loss"][s - 1] - logged[s]) / abs(logged[s]) for s in steps]
    return {
        "run": str(run),
        "steps": steps,
        "max_relative_difference": max(differences, default=float("nan")),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--optimizer", choices=("allreduce", "decentralized"), required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--diagnose", action="store_true", help="All-Reduce: shadow per-rank moments")
    parser.add_argument("--diagnose-every", type=int, default=50)
    parser.add_argument("--check-against", type=Path, help="a recipe run dir logged with train.log_every=1")
    parser.add_argument("--bleu", action="store_true", help="score the final average on the test split")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="where the simulated ranks compute (cpu, cuda)")
    parser.add_argument(
        "--optimizer-class",
        default="decentadam.DecentralizedAdam",
        help="the decentralized optimizer, module.Class (a probe's subclass of DecentralizedAdam)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.diagnose and args.optimizer != "allreduce":
        parser.error("--diagnose compares with All-Reduce's moments: use it with --optimizer allreduce")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config.load(
        args.preset, [f"data={args.data}", f"optim.optimizer={args.optimizer}", *args.overrides]
    )
    result = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.parity.workers", *(argv or sys.argv[1:])]),
        "workers": args.workers,
        "tokens_per_worker": cfg.train.global_tokens // args.workers,
        "config": dataclasses.asdict(cfg),
        **train(args, cfg),
    }
    if args.check_against:
        result["check"] = compare_with_run(result, args.check_against)
        print(json.dumps(result["check"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
