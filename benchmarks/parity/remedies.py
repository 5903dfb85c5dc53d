"""The remedies screened for decentralized Adam's per-step gap, as update rules on n simulated ranks.

Each rule updates the ranks' flat parameter vectors ``X`` (n, d) from their gradients ``G`` (n, d)
taken on the translation recipe's batches (the ranks of :mod:`benchmarks.parity.workers`), with the
same "communicate while adapting" mixing as ``DecentralizedAdam``: ``X <- W(t) X - lr * D`` where
``W(t)`` is the topology's mixing matrix and ``D`` each rank's direction. They are written out
plainly to compare candidates before one is built into the library (``corrected-v`` with the
``momentum`` estimator is ``DecentralizedAdam(second_moment="all_ranks")``)::

    python -m benchmarks.parity.remedies --preset demo-synthetic-en-de --data DEMO --rule corrected-v \\
        --topology aer --out runs/remedies/corrected-v.json

Rules (bytes: what a rank sends per step beyond the parameters):

=================  ======================================================================  =========
``allreduce``      AdamW on the mean gradient (the reference)                               --
``local``          each rank's own Adam (DAdam); ``--accum-steps s`` AccumAdam, with         0
                   ``--window-betas`` the betas raised to s once per window (remedy a)
``v-oracle``       m from the rank's gradient, v from the all-reduced gradient              params
``corrected-v``    v minus the share of the rank's noise that averaging over n removes,      0
                   the noise estimated by ``--estimator``: ``momentum`` (deviation from
                   the momentum), ``difference`` (of consecutive gradients),
                   ``square`` (v - m^2) or ``lag`` (the mean's square from consecutive
                   gradients' product, which an oscillating mean keeps) (remedy e)
``tracking``       Adam on a tracked average gradient y_i = sum_j W_ij y_j + g_i - g_i'      params
                   (gradient tracking, remedy d)
``recovered``      v from the neighbourhood's mean gradient, recovered from the parameter   0
                   exchange (each rank knows its own step; the mixed weights tell the
                   neighbours' mean step; remedy c at no extra bytes; exact on the complete
                   graph, inexact where the previous mixing left the ranks apart)
``gm-oracle``      All-Reduce's momentum and v before this step plus the rank's own         params
                   gradient (the ideal that quasi-global momentum approximates, remedy g)
=================  ======================================================================  =========

``--intra L`` averages gradients inside nodes of L ranks before any rule (remedy f: the
parameter bytes again, on the fast link). ``--mix-weight alpha`` mixes lazily,
``X <- ((1 - alpha) I + alpha W(t)) X - lr * D`` (no extra bytes). ``--eval-at`` moves the point
where a rank takes its next gradient away from the weights it sends: ``mixed`` (before its own
step) or, with ``corrected-v``, ``predicted`` (plus the part of its step it expects the other
ranks to share); the mean of the ranks' weights is unchanged, so these isolate the effect of
where each rank's gradient is taken.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from benchmarks.parity.workers import Workers, schedule
from decentadam.topology import build as build_topology
from recipes.translation import config

RULES = ("allreduce", "local", "v-oracle", "corrected-v", "tracking", "recovered", "gm-oracle")
ESTIMATORS = ("momentum", "difference", "square", "lag")


class Ranks:
    """The ranks' parameters as rows of one (n, d) tensor that their models' parameters view."""

    def __init__(self, world: Workers) -> None:
        self.world, self.n = world, world.workers
        params = [[p for p in m.parameters() if p.requires_grad] for m in world.models]
        self.d = sum(p.numel() for p in params[0])
        self.X, self.G = torch.zeros(self.n, self.d), torch.zeros(self.n, self.d)
        for rank, rank_params in enumerate(params):
            offset = 0
            for p in rank_params:
                view = slice(offset, offset + p.numel())
                self.X[rank, view].copy_(p.detach().reshape(-1))
                p.data = self.X[rank, view].view_as(p)
                p.grad = self.G[rank, view].view_as(p)
                offset += p.numel()

    def gradients(self) -> float:
        """Every rank's gradient at its own parameters into ``G``; the ranks' mean loss."""
        self.G.zero_()
        return sum(self.world.backward(r, m) for r, m in enumerate(self.world.models)) / self.n


class Rule:
    """Adam hyper-parameters and the topology; ``step`` updates ``ranks.X`` in place."""

    expected: Tensor  # --eval-at predicted: the part of each rank's step it expects the others to share

    def __init__(
        self, ranks: Ranks, args: argparse.Namespace, betas: tuple[float, float], eps: float
    ) -> None:
        self.ranks, self.args, self.n, self.t = ranks, args, ranks.n, 0
        self.beta1, self.beta2 = betas
        self.eps = eps
        shape = (ranks.n, ranks.d)
        self.M, self.V = torch.zeros(shape), torch.zeros(shape)
        self.topology = build_topology(args.topology, ranks.n, args.local_world_size) if ranks.n > 1 else None
        self.extra = {name: torch.zeros(shape) for name in self.buffers()}
        self.sent = ranks.X.clone()  # what each rank sent last; X is where its next gradient is taken

    def buffers(self) -> tuple[str, ...]:
        return ()

    def W(self, t: int) -> Tensor:
        if self.topology is None:
            return torch.ones(1, 1)
        return torch.as_tensor(self.topology.mixing_matrix(t), dtype=torch.float32)

    def step(self, lr: float) -> None:
        G = self.ranks.G
        if self.args.intra > 1:  # the mean gradient of each node's ranks
            by_node = G.view(self.n // self.args.intra, self.args.intra, -1).mean(1, keepdim=True)
            G.copy_(by_node.expand(-1, self.args.intra, -1).reshape(self.n, -1))
        X, sent = self.ranks.X, self.sent
        mixed = sent.clone() if self.t == 0 else self.W(self.t) @ sent  # x_j(t) mixed before the step
        if self.args.mix_weight != 1.0:  # lazy mixing: W' = (1 - alpha) I + alpha W
            mixed.mul_(self.args.mix_weight).add_(sent, alpha=1 - self.args.mix_weight)
        delta = mixed - sent
        self.t += 1
        sent.copy_(mixed - lr * self.direction(G, delta, lr))
        if self.args.eval_at == "predicted":  # the part of its step a rank expects the others to share
            X.copy_(mixed - lr * self.expected)
        else:
            X.copy_(sent if self.args.eval_at == "sent" else mixed)

    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        raise NotImplementedError

    def adam(self, m: Tensor, v: Tensor, k: int) -> Tensor:
        bc1, bc2 = 1 - self.beta1**k, 1 - self.beta2**k
        return (m / bc1) / ((v / bc2).sqrt() + self.eps)


class AllReduce(Rule):
    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        g = G.mean(0, keepdim=True).expand_as(G)
        self.M.lerp_(g, 1 - self.beta1)
        self.V.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        return self.adam(self.M, self.V, self.t)


class Local(Rule):
    def buffers(self) -> tuple[str, ...]:
        return ("window",) if self.args.accum_steps > 1 else ()

    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        s, t = self.args.accum_steps, self.t
        beta1, beta2 = self.beta1, self.beta2
        if s == 1:
            self.M.lerp_(G, 1 - beta1)
            self.V.mul_(beta2).addcmul_(G, G, value=1 - beta2)
            return self.adam(self.M, self.V, t)
        if self.args.window_betas:  # the moments' memory in steps as with s = 1
            beta1, beta2 = beta1**s, beta2**s
        m = torch.lerp(self.M, G, 1 - beta1)
        v = self.V * beta2 + (1 - beta2) * G * G
        k = -(-t // s)
        d: Tensor = (m / (1 - beta1**k)) / ((v / (1 - beta2**k)).sqrt() + self.eps)
        window = self.extra["window"]
        window.add_(G, alpha=1 / s)
        if t % s == 0:
            self.M.lerp_(window, 1 - beta1)
            self.V.mul_(beta2).addcmul_(window, window, value=1 - beta2)
            window.zero_()
        return d


class VOracle(Rule):
    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        g = G.mean(0, keepdim=True).expand_as(G)
        self.M.lerp_(G, 1 - self.beta1)
        self.V.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        return self.adam(self.M, self.V, self.t)


class CorrectedV(Rule):
    def buffers(self) -> tuple[str, ...]:
        return ("noise", "previous")

    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        beta1, beta2, t, n = self.beta1, self.beta2, self.t, self.n
        noise, previous = self.extra["noise"], self.extra["previous"]
        estimator = self.args.estimator
        if t > 1 and estimator == "momentum":
            deviation = G - self.M / (1 - beta1 ** (t - 1))
            noise.mul_(beta2).addcmul_(deviation, deviation, value=(1 - beta2) * (1 + beta1) / 2)
        elif t > 1 and estimator == "difference":
            difference = G - previous
            noise.mul_(beta2).addcmul_(difference, difference, value=(1 - beta2) / 2)
        elif t > 1 and estimator == "lag":  # E[g_t g_(t-1)]: the mean's square, oscillating or not
            noise.mul_(beta2).addcmul_(G, previous, value=1 - beta2)
        previous.copy_(G)
        self.M.lerp_(G, 1 - beta1)
        self.V.mul_(beta2).addcmul_(G, G, value=1 - beta2)
        m_hat, v_hat = self.M / (1 - beta1**t), self.V / (1 - beta2**t)
        if estimator == "square":
            v_hat = v_hat / n + (1 - 1 / n) * m_hat * m_hat
        elif estimator == "lag" and t > 1:
            mean_square = torch.minimum((noise / (1 - beta2 ** (t - 1))).abs(), v_hat)
            own = v_hat
            v_hat = mean_square + (v_hat - mean_square) / n
        elif t > 1:
            corrected = v_hat - (1 - 1 / n) * noise / (1 - beta2 ** (t - 1))
            own = v_hat
            v_hat = torch.maximum(corrected, v_hat / n)
        d = m_hat / (v_hat.sqrt() + self.eps)
        if self.args.eval_at == "predicted":
            # E[mean_j D_j | m_i]: m_i = mu + e_i; mu shrunk by rho = mu^2 / (mu^2 + Var e), e_i by 1/n
            if t > 1 and estimator != "square":
                noise_hat = noise / (1 - beta2 ** (t - 1))
                signal = (own - noise_hat).clamp_(min=0)
                rho = signal / (signal + noise_hat * (1 - beta1) / (1 + beta1) + 1e-30)
                self.expected = d * (rho + (1 - rho) / n)
            else:
                self.expected = d / n
        return d


class GlobalMomentumOracle(Rule):
    """An oracle: the momentum and v of All-Reduce (from the mean gradient) before this step, and
    this step's own gradient: D_i = (beta1 Mbar + (1 - beta1) g_i) / sqrt(Vbar), so that the mean of
    the ranks' steps is All-Reduce's and only the (1 - beta1) g_i part differs between ranks."""

    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        beta1, beta2, t = self.beta1, self.beta2, self.t
        g = G.mean(0, keepdim=True)
        m = torch.lerp(self.M[:1], G, 1 - beta1)  # (n, d): the mean momentum with each own gradient
        self.M.lerp_(g.expand_as(G), 1 - beta1)
        self.V.mul_(beta2).addcmul_(g.expand_as(G), g.expand_as(G), value=1 - beta2)
        return self.adam(m, self.V, t)


class Tracking(Rule):
    def buffers(self) -> tuple[str, ...]:
        return ("tracker", "previous")

    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        tracker, previous = self.extra["tracker"], self.extra["previous"]
        if self.t == 1:
            tracker.copy_(G)
        else:  # mixed with the parameters' matrix, then this rank's gradient change added
            tracker.copy_(self.W(self.t - 1) @ tracker + G - previous)
        previous.copy_(G)
        self.M.lerp_(tracker, 1 - self.beta1)
        self.V.mul_(self.beta2).addcmul_(tracker, tracker, value=1 - self.beta2)
        return self.adam(self.M, self.V, self.t)


class Recovered(Rule):
    """Local momentum; v from the neighbourhood's mean gradient recovered from the mixing.

    Rank i stepped ``lr_{t-1} * P_i m_i / bc1`` and the mixing moved it by ``delta``; with common
    scales the neighbourhood's mean momentum is ``m_i - bc1 * delta / (lr P_i)``, whose innovation
    over the previous mean momentum ``Mbar`` is the mean gradient ``ghat`` (one step late)."""

    previous_lr, previous_bc1 = 0.0, 1.0  # of the last step, which the next mixing decodes

    def buffers(self) -> tuple[str, ...]:
        return ("mean_momentum", "scale", "sent", "mean_v")

    def direction(self, G: Tensor, delta: Tensor, lr: float) -> Tensor:
        beta1, beta2, t, n = self.beta1, self.beta2, self.t, self.n
        mean_momentum, scale, sent, mean_v = (self.extra[k] for k in self.buffers())
        if t > 1:
            mixed = (torch.diagonal(self.W(t - 1)) < 1).unsqueeze(1)  # exchanged at all
            recovered = sent - self.previous_bc1 * delta / (self.previous_lr * scale)
            recovered = torch.where(mixed, recovered, sent)
            ghat = (recovered - beta1 * mean_momentum) / (1 - beta1)
            mean_momentum.copy_(recovered)
            mean_v.mul_(beta2).addcmul_(ghat, ghat, value=1 - beta2)
        self.M.lerp_(G, 1 - beta1)  # the rank's own momentum
        bc1 = 1 - beta1**t
        if t == 1:  # no mean gradient yet: an SGD step that the next mixing decodes exactly
            p = torch.full_like(G, bc1)
        else:
            v = beta2 * mean_v + (1 - beta2) * G * G / n
            p = 1.0 / ((v / (1 - beta2**t)).sqrt() + self.eps)
        sent.copy_(self.M)
        scale.copy_(p)
        self.previous_lr, self.previous_bc1 = lr, bc1
        return p * self.M / bc1


RULE_CLASSES = {
    "allreduce": AllReduce, "local": Local, "v-oracle": VOracle, "corrected-v": CorrectedV,
    "tracking": Tracking, "recovered": Recovered, "gm-oracle": GlobalMomentumOracle,
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rule", choices=RULES, required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--topology", default="aer")
    parser.add_argument("--local-world-size", type=int, default=2)
    parser.add_argument("--accum-steps", type=int, default=1, help="local: AccumAdam's window")
    parser.add_argument("--window-betas", action="store_true", help="local: betas**s per window")
    parser.add_argument("--estimator", choices=ESTIMATORS, default="momentum", help="corrected-v")
    parser.add_argument("--intra", type=int, default=1, help="average gradients in nodes of this many ranks")
    parser.add_argument(
        "--eval-at",
        choices=("sent", "mixed", "predicted"),
        default="sent",
        help="where a rank takes its next gradient: the weights it sent (its own step applied), the "
        "mixed weights before its own step, or (corrected-v) the mixed weights plus the part of its step "
        "it expects the others to share",
    )
    parser.add_argument(
        "--mix-weight", type=float, default=1.0, help="alpha of the lazy mixing (1 - alpha) x_i + alpha W x"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="recipe settings, e.g. optim.lr=2e-3"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config.load(args.preset, [f"data={args.data}", *args.overrides])
    o = cfg.optim
    world = Workers(cfg, args.workers)
    ranks = Ranks(world)
    rule = RULE_CLASSES[args.rule](ranks, args, o.betas_allreduce, o.eps)
    factor = schedule(o.warmup_steps)
    evaluator = world.new_model()
    curve, losses, begin = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        losses.append(ranks.gradients())
        with torch.no_grad():
            rule.step(o.lr * factor(step - 1))
        if step % args.eval_every == 0 or step == args.steps:
            mean = ranks.X.mean(0)
            offset = 0
            with torch.no_grad():
                for p in (p for p in evaluator.parameters() if p.requires_grad):
                    p.copy_(mean[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            spread = float((ranks.X - mean).square().sum(1).mean() / mean.square().sum())
            point = {"step": step, "valid_nll": world.val_nll(evaluator), "consensus_distance_rel": spread}
            point["seconds"] = time.perf_counter() - begin
            curve.append(point)
            print(json.dumps(point), flush=True)
    result = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.parity.remedies", *(argv or sys.argv[1:])]),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "curve": curve,
        "train_loss": losses,
        "lr_schedule_check": math.isclose(factor(0), 1 / max(o.warmup_steps, 1)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
