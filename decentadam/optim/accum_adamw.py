"""AccumAdamW: AdamW whose moment history advances once per window of ``accum_steps`` steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias, TypeGuard

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["AccumAdamW", "MomentSource", "ParamsT", "accum_adamw"]

ParamsT: TypeAlias = Iterable[Tensor] | Iterable[dict[str, Any]]


class AccumAdamW(Optimizer):
    r"""Adam with decoupled weight decay and the accumulation trick (Wang et al.), purely local.

    With window length ``s = accum_steps``, parameter ``x``, gradient ``g_t`` at local step
    ``t = 1, 2, ...`` and committed moments ``M, V`` (zero at start)::

        k      = ceil(t / s)                                   # number of the current window
        m      = beta1 * M + (1 - beta1) * g_t                 # a preview of the moments with g_t
        v      = beta2 * V + (1 - beta2) * g_t**2
        x      = x * (1 - lr * weight_decay)
        x      = x - lr * (m / (1 - beta1**k)) / (sqrt(v / (1 - beta2**k)) + eps)
        b      = b + g_t / s                                   # the window's mean gradient
        if t % s == 0:                                         # commit once per window
            M = beta1 * M + (1 - beta1) * b
            V = beta2 * V + (1 - beta2) * b**2
            b = 0

    Every step uses the current gradient, but the history in ``M, V`` only moves once per window and
    with the window's mean gradient, which cuts the variance that small local batches put into
    ``V``. With ``accum_steps=1`` this is exactly :class:`torch.optim.AdamW`.

    Second moment of a mean of ``n = noise_ranks`` gradients (``accum_steps=1`` only). Averaging n
    independent gradients keeps their mean ``mu`` and divides their noise variance ``sigma^2`` by n,
    so All-Reduce's Adam, which sees the mean over n ranks, divides by ``mu^2 + sigma^2 / n`` where a
    rank's own ``V`` holds ``mu^2 + sigma^2``. With ``noise_ranks=n > 1`` each rank estimates its
    gradient noise from how far each gradient falls from the running mean and removes the share that
    averaging over n ranks would remove, with no communication (the decentralized optimizer sets n
    to the world size)::

        S = beta2 * S + (1 - beta2) * (1 + beta1) / 2 * (g_t - M_{t-1} / (1 - beta1**(t-1)))**2
                                                               # t > 1; S holds sigma^2 (see below)
        v = V / (1 - beta2**t);   s = S / (1 - beta2**(t-1))   # bias-corrected
        v = max(v - (1 - 1/n) * s,  v / n)                     # the step grows at most sqrt(n)-fold

    ``M_{t-1}`` is the momentum before ``g_t``: ``g_t`` is independent of it, and in steady state it
    holds ``sigma^2 (1 - beta1) / (1 + beta1)`` of noise, hence the factor ``(1 + beta1) / 2``. Where
    the mean gradient drifts, ``S`` also holds the drift and the floor ``v / n`` bounds the step. The
    first step, with no ``S`` yet, is AdamW's. ``noise_ranks=1`` is AdamW exactly.

    Weight decay applies to every parameter of a group with ``weight_decay > 0``; leave biases and
    norms out by giving them their own group with ``weight_decay=0.0``, as with AdamW.

    Per-parameter state (``optimizer.state[p]``), fixed keys:
        ``step``: 0-dim float64 tensor, local steps taken (``t``; exact to 2**53, where float32 would
        stop counting at 2**24; a float32 step loaded from torch's AdamW is converted at the next
        step);
        ``exp_avg``: ``M``; ``exp_avg_sq``: ``V``;
        ``grad_accum``: ``b``, the running mean gradient of the open window (only when
        ``accum_steps > 1``);
        ``noise_sq``: ``S``, the gradient noise estimate (only when ``noise_ranks > 1``, and dropped
        once an estimate ``group_sq`` replaces it: :class:`MomentSource`).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay coefficient.
        accum_steps: window length ``s`` (``>= 1``).
        noise_ranks: ``n``: the second moment describes the mean of n such gradients (``>= 1``;
            ``> 1`` needs ``accum_steps=1``).
        foreach: use the multi-tensor (``torch._foreach_*``) path; ``None`` picks it when every
            parameter is on CPU or CUDA. On CPU it runs over cache-sized slices and is about twice
            as fast as the for-loop path (benchmarks/optimizer_step.py).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_steps: int = 1,
        noise_ranks: int = 1,
        *,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            **make_defaults(lr, betas, eps, weight_decay, accum_steps, foreach),
            "noise_ranks": noise_ranks,
        }
        check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.add_param_group`, and check the group's hyper-parameters."""
        super().add_param_group(param_group)
        check_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one AccumAdamW step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            # a group saved before noise_ranks existed is its own (n = 1)
            step_group(self.state, group, params, MomentSource(noise_ranks=group.get("noise_ranks", 1)))
        return loss


@dataclass(frozen=True)
class MomentSource:
    """What a step divides by beyond the rank's own ``V``, told by the caller (no param-group key):
    ``n`` (``noise_ranks``), the floor's ``F`` (``floor_ranks``, None: ``n``), the period ``k`` of an
    estimate ``A`` (state ``group_sq``, ``group_updates``) that replaces ``S`` (``estimate_every``),
    and whether a shared ``P`` (state ``shared_sq``) replaces the rank's own (``shared``): the
    formulas are :func:`accum_adamw`'s. Corrections (``n > 1``) need ``accum_steps=1``."""

    noise_ranks: int = 1
    floor_ranks: int | None = None
    estimate_every: int | None = None
    shared: bool = False


OWN_MOMENT = MomentSource()
"""The rank's own second moment: AccumAdamW with ``noise_ranks=1``."""


def make_defaults(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    accum_steps: int,
    foreach: bool | None,
) -> dict[str, Any]:
    """The param-group defaults of the AccumAdamW update; raises ValueError naming the first invalid one."""
    defaults = {
        "lr": lr,
        "betas": betas,
        "eps": eps,
        "weight_decay": weight_decay,
        "accum_steps": accum_steps,
        "foreach": foreach,
    }
    check_group(defaults)
    return defaults


def is_count(value: object, least: int) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` (not a ``bool``) of at least ``least``: the check of every
    step count and period among the optimizers' arguments."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first invalid hyper-parameter of a param group (or the defaults).

    Optimizers call it from ``add_param_group``, so values given per group are checked as well.
    """
    where = f" (param group {group['name']!r})" if "name" in group else ""
    lr, betas, eps = group["lr"], group["betas"], group["eps"]
    weight_decay, accum_steps = group["weight_decay"], group["accum_steps"]
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}{where}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}{where}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"betas[0] must be in [0, 1), got {betas[0]}{where}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"betas[1] must be in [0, 1), got {betas[1]}{where}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}{where}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}{where}")
    if not is_count(accum_steps, 1):
        raise ValueError(f"accum_steps must be an integer >= 1, got {accum_steps!r}{where}")
    noise_ranks = group.get("noise_ranks", 1)  # AccumAdamW's (groups saved before it existed: 1)
    if not is_count(noise_ranks, 1):
        raise ValueError(f"noise_ranks must be an integer >= 1, got {noise_ranks!r}{where}")
    if noise_ranks > 1 and accum_steps > 1:
        raise ValueError(
            f"noise_ranks={noise_ranks} corrects the second moment of single-step gradients, but "
            f"accum_steps={accum_steps}{where}: use accum_steps=1 with it, or noise_ranks=1 (for "
            "DecentralizedAdam: second_moment='local') to keep the accumulation window"
        )


def corrected_second_moment(st: dict[str, Any], beta2: float, n: int, floored: bool = True) -> Tensor:
    """The second moment a rank of ``noise_ranks = n`` divides by on its own, from its state after a
    step: ``max(v - (1 - 1/n) s, v / n)`` (bias-corrected; ``v`` alone after the first step or with
    ``n = 1``; ``floored=False``: ``v - (1 - 1/n) s``, which may be negative). A new tensor: what ranks
    average into a shared ``P`` (:class:`MomentSource`)."""
    t = int(st["step"].item())
    second: Tensor = st["exp_avg_sq"].div(1.0 - beta2**t)
    noise_sq = st.get("noise_sq")
    if n == 1 or t < 2 or noise_sq is None:
        return second
    corrected = torch.add(second, noise_sq, alpha=-(1.0 - 1.0 / n) / (1.0 - beta2 ** (t - 1)))
    if not floored:
        return corrected
    return torch.maximum(corrected, second.div_(n), out=corrected)


def step_group(
    state: dict[Tensor, dict[str, Any]],
    group: dict[str, Any],
    params: list[Tensor],
    source: MomentSource = OWN_MOMENT,
) -> None:
    """Lazily create state for ``params`` (all with gradients) of ``group`` and take one step, with
    the second moment of ``source``.

    Shared by :class:`AccumAdamW` and the decentralized optimizer, which calls it per bucket.
    """
    if not params:
        return
    accum_steps: int = group["accum_steps"]
    noise_ranks = source.noise_ranks
    v_every = source.estimate_every if noise_ranks > 1 else None  # k: A replaces S where it has updates
    floor_ranks = noise_ranks if source.floor_ranks is None else source.floor_ranks
    grads, exp_avgs, exp_avg_sqs, grad_accums, noise_sqs, steps = [], [], [], [], [], []
    group_sqs: list[Tensor | None] = []
    group_updates: list[int] = []
    shared_sqs: list[Tensor | None] = []
    for p in params:
        grad = p.grad
        assert grad is not None
        if grad.is_sparse:
            raise RuntimeError("AccumAdamW does not support sparse gradients; use dense embeddings")
        if torch.is_complex(p):
            raise RuntimeError("AccumAdamW does not support complex parameters; view them as real")
        st = state[p]
        if "step" not in st:  # a group_sq folded in before the first step may be there already
            st["step"] = torch.tensor(0.0, dtype=torch.float64)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif st["step"].dtype != torch.float64:
            # float32 (torch's AdamW, or our state before float64) stops counting at 2**24 = 16.8M steps,
            # after which ``t % s == 0`` would commit the moments on every step; values below are exact
            st["step"] = st["step"].to(torch.float64)
        if accum_steps > 1 and "grad_accum" not in st:
            st["grad_accum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        updates = st.get("group_updates", 0) if v_every else 0
        if updates > 0:  # A replaces S from now on (it is never reset): S is not kept
            st.pop("noise_sq", None)
        elif noise_ranks > 1 and "noise_sq" not in st:
            st["noise_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grads.append(grad)
        exp_avgs.append(st["exp_avg"])
        exp_avg_sqs.append(st["exp_avg_sq"])
        steps.append(st["step"])
        if accum_steps > 1:
            grad_accums.append(st["grad_accum"])
        if noise_ranks > 1:
            noise_sqs.append(st["noise_sq"] if updates == 0 else None)
        group_sqs.append(st["group_sq"] if updates > 0 else None)
        group_updates.append(updates)
        shared_sqs.append(st.get("shared_sq") if noise_ranks > 1 and source.shared else None)
    beta1, beta2 = group["betas"]
    accum_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        grad_accums,
        steps,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        accum_steps=accum_steps,
        foreach=group["foreach"],
        noise_ranks=noise_ranks,
        noise_sqs=noise_sqs,
        group_sqs=group_sqs if v_every else None,
        group_updates=group_updates,
        v_every=v_every or 1,
        floor_ranks=floor_ranks,
        shared_sqs=shared_sqs,
    )


def accum_adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grad_accums: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    accum_steps: int,
    foreach: bool | None = None,
    noise_ranks: int = 1,
    noise_sqs: list[Tensor | None] | None = None,
    group_sqs: list[Tensor | None] | None = None,
    group_updates: list[int] | None = None,
    v_every: int = 1,
    floor_ranks: int | None = None,
    shared_sqs: list[Tensor | None] | None = None,
) -> None:
    """Functional AccumAdamW: the update of :class:`AccumAdamW`, in place on every list.

    ``grad_accums`` may be empty when ``accum_steps == 1``, ``noise_sqs`` when ``noise_ranks == 1``.
    ``state_steps`` are incremented here.

    ``group_sqs`` (``noise_ranks > 1`` only): per parameter ``A``, an estimate of the second moment
    of the mean gradient (from other ranks' gradients: :mod:`decentadam.exchanges.group_gradient`),
    updated ``group_updates`` (``u``) times, every ``v_every`` (``k``) steps, or ``None`` where
    ``u = 0``. Where given it replaces the noise correction: ``v = max(A / (1 - beta2**(k u)), V /
    (1 - beta2**t) / n)``, and that parameter's ``S`` is neither read nor updated (its ``noise_sqs``
    entry may be ``None``).

    ``floor_ranks`` (``F``, default ``n``; ``noise_ranks > 1`` only): the floor of the corrected
    second moment is ``V / (1 - beta2**t) / F``, so the step grows at most ``sqrt(F)``-fold over the
    rank's own (``N**2`` where nodes share ``A``: :mod:`decentadam.exchanges.moments`).

    ``shared_sqs`` (``noise_ranks > 1`` only): per parameter ``P``, a bias-corrected second moment
    shared by all ranks, or ``None``. Where given, ``v = max(P, V / (1 - beta2**t) / n**2)``: the
    ranks divide by one ``P``, and a rank alone in seeing a gradient (a rare token) may step ``n``
    times its own Adam step there, as All-Reduce's mean would ask. ``S`` is still updated (the
    rank's next estimate).
    """
    noise_sqs = noise_sqs if noise_sqs is not None else []
    group_sqs = group_sqs if group_sqs is not None else [None] * len(params)
    shared: list[Tensor | None] = shared_sqs if shared_sqs is not None else [None] * len(params)
    if any(p is not None for p in shared) and (noise_ranks == 1 or any(a is not None for a in group_sqs)):
        raise ValueError("shared_sqs need noise_ranks > 1 and no group_sqs")
    u_values = group_updates if group_updates is not None else [0] * len(params)
    if accum_steps > 1 and len(grad_accums) != len(params):
        raise ValueError("accum_steps > 1 needs one grad_accum tensor per parameter")
    if noise_ranks > 1 and (accum_steps > 1 or len(noise_sqs) != len(params)):
        raise ValueError("noise_ranks > 1 needs accum_steps == 1 and one noise_sq tensor per parameter")
    if any(a is not None for a in group_sqs) and noise_ranks == 1:
        raise ValueError("group_sqs replace the noise correction: they need noise_ranks > 1")
    u_values = [u if a is not None else 0 for a, u in zip(group_sqs, u_values, strict=True)]
    if noise_ranks > 1 and any(s is None and u == 0 for s, u in zip(noise_sqs, u_values, strict=True)):
        raise ValueError("noise_ranks > 1: every parameter needs its noise_sq or its group_sq (with u > 0)")
    floor_ranks = noise_ranks if floor_ranks is None else floor_ranks
    if floor_ranks < 1:
        raise ValueError(f"floor_ranks must be >= 1, got {floor_ranks}")
    if foreach is None:
        foreach = all(p.device.type in ("cpu", "cuda") for p in params)
    for step in state_steps:
        step += 1
    t_values = [int(step.item()) for step in state_steps]
    hyper = _Hyper(lr, beta1, beta2, eps, weight_decay, accum_steps, noise_ranks, v_every, floor_ranks)
    extra = grad_accums if accum_steps > 1 else noise_sqs if noise_ranks > 1 else []
    if foreach:
        for index_list in _group_for_foreach(params, grads, t_values, u_values, shared):
            u = u_values[index_list[0]]
            has_shared = shared[index_list[0]] is not None
            # one extra list: b (accum_steps > 1), S (noise_ranks > 1 and no A yet) or A (u > 0)
            if u > 0:  # every parameter of this list has its A, which replaces S
                extra_list: list[Tensor | None] = [group_sqs[i] for i in index_list]
            else:
                extra_list = [extra[i] for i in index_list] if extra else []
            lists = [[tensors[i] for i in index_list] for tensors in (params, grads, exp_avgs, exp_avg_sqs)]
            selected = lists + ([[t for t in extra_list if t is not None]] if extra_list else [])
            if has_shared:
                selected.append([p for p in (shared[i] for i in index_list) if p is not None])
            for p_, g_, m_, v_, *b_ in _cpu_chunks(selected):
                _foreach_accum_adamw(
                    p_,
                    g_,
                    m_,
                    v_,
                    b_[0] if accum_steps > 1 else [],
                    t_values[index_list[0]],
                    hyper,
                    b_[0] if noise_ranks > 1 and u == 0 else [],
                    b_[0] if u > 0 else [],
                    u,
                    b_[-1] if has_shared else [],
                )
    else:
        for i, param in enumerate(params):
            _single_accum_adamw(
                param,
                grads[i],
                exp_avgs[i],
                exp_avg_sqs[i],
                grad_accums[i] if accum_steps > 1 else None,
                t_values[i],
                hyper,
                noise_sqs[i] if noise_ranks > 1 else None,
                group_sqs[i],
                u_values[i],
                shared[i],
            )


class _Hyper(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    accum_steps: int
    noise_ranks: int = 1
    v_every: int = 1
    floor_ranks: int = 1
    """F: the corrected second moment is at least ``v / F`` (``noise_ranks`` unless lowered)."""

    def bias_corrections(self, t: int) -> tuple[float, float]:
        """(1 - beta1**k, sqrt(1 - beta2**k)) with k = ceil(t / s), the window number."""
        k = -(-t // self.accum_steps)
        return 1.0 - self.beta1**k, math.sqrt(1.0 - self.beta2**k)

    def noise_terms(self, t: int) -> tuple[float, float, float, float]:
        """For step ``t > 1`` of the noise correction: (1 / (1 - beta1**(t-1)), the weight of the new
        squared deviation in S, 1 / (1 - beta2**(t-1)) (S's bias correction) and 1 - 1/n)."""
        beta1, beta2 = self.beta1, self.beta2
        return (
            1.0 / (1.0 - beta1 ** (t - 1)),
            (1.0 - beta2) * (1.0 + beta1) / 2.0,
            1.0 / (1.0 - beta2 ** (t - 1)),
            1.0 - 1.0 / self.noise_ranks,
        )

    def group_correction(self, u: int) -> float:
        """``1 - beta2**(k u)``: the bias correction of ``A`` after ``u`` updates, one per ``k`` steps."""
        return 1.0 - self.beta2 ** (self.v_every * u)


def _single_accum_adamw(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad_accum: Tensor | None,
    t: int,
    hyper: _Hyper,
    noise_sq: Tensor | None = None,
    group_sq: Tensor | None = None,
    u: int = 0,
    shared_sq: Tensor | None = None,
) -> None:
    lr, beta1, beta2, eps, weight_decay, accum_steps = hyper[:6]
    bias_correction1, bias_correction2_sqrt = hyper.bias_corrections(t)
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    if noise_sq is not None and group_sq is None and t > 1:  # S: g_t's deviation from the momentum before
        momentum_scale, weight, _, _ = hyper.noise_terms(t)
        deviation = torch.sub(grad, exp_avg, alpha=momentum_scale)
        noise_sq.mul_(beta2).addcmul_(deviation, deviation, value=weight)
    if grad_accum is None:  # accum_steps == 1: the committed moments are the preview (AdamW)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        m = exp_avg
        if hyper.noise_ranks > 1 and (t > 1 or group_sq is not None or shared_sq is not None):
            second = exp_avg_sq / bias_correction2_sqrt**2  # v, bias-corrected
            floor = hyper.floor_ranks
            if shared_sq is not None:  # P, shared by every rank, replaces the rank's own estimate
                corrected, floor = shared_sq.clone(), hyper.noise_ranks**2
            elif group_sq is not None:  # A from the exchange group's gradients replaces V - (1 - 1/n) S
                corrected = group_sq / hyper.group_correction(u)
            else:
                assert noise_sq is not None, "noise_ranks > 1 without A needs S"
                _, _, noise_scale, share = hyper.noise_terms(t)
                corrected = torch.add(second, noise_sq, alpha=-share * noise_scale)
            denom = torch.maximum(corrected, second.div_(floor)).sqrt_().add_(eps)
            param.addcdiv_(m, denom, value=-lr / bias_correction1)
            return
        denom = exp_avg_sq.sqrt()
    else:
        m = torch.lerp(exp_avg, grad, 1.0 - beta1)
        denom = torch.mul(exp_avg_sq, beta2).addcmul_(grad, grad, value=1.0 - beta2).sqrt_()
    denom.div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(m, denom, value=-lr / bias_correction1)
    if grad_accum is not None:
        grad_accum.add_(grad, alpha=1.0 / accum_steps)
        if t % accum_steps == 0:
            exp_avg.lerp_(grad_accum, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad_accum, grad_accum, value=1.0 - beta2)
            grad_accum.zero_()


def _foreach_accum_adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grad_accums: list[Tensor],
    t: int,
    hyper: _Hyper,
    noise_sqs: list[Tensor] | None = None,
    group_sqs: list[Tensor] | None = None,
    u: int = 0,
    shared_sqs: list[Tensor] | None = None,
) -> None:
    lr, beta1, beta2, eps, weight_decay, accum_steps = hyper[:6]
    bias_correction1, bias_correction2_sqrt = hyper.bias_corrections(t)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    if hyper.noise_ranks > 1 and (t > 1 or group_sqs or shared_sqs):  # see _single_accum_adamw
        if noise_sqs and t > 1:  # S, where no A replaces it
            momentum_scale, weight, _, _ = hyper.noise_terms(t)
            deviations = torch._foreach_mul(exp_avgs, momentum_scale)
            torch._foreach_sub_(deviations, grads)  # sign does not matter: it is squared
            torch._foreach_mul_(noise_sqs, beta2)
            torch._foreach_addcmul_(noise_sqs, deviations, deviations, value=weight)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        second = torch._foreach_div(exp_avg_sqs, bias_correction2_sqrt**2)
        floor = hyper.floor_ranks
        if shared_sqs:
            corrected, floor = torch._foreach_mul(shared_sqs, 1.0), hyper.noise_ranks**2
        elif group_sqs:
            corrected = torch._foreach_div(group_sqs, hyper.group_correction(u))
        else:
            assert noise_sqs, "noise_ranks > 1 without A needs S"
            _, _, noise_scale, share = hyper.noise_terms(t)
            corrected = torch._foreach_add(second, noise_sqs, alpha=-share * noise_scale)
        torch._foreach_div_(second, floor)
        torch._foreach_maximum_(corrected, second)
        torch._foreach_sqrt_(corrected)
        torch._foreach_add_(corrected, eps)
        torch._foreach_addcdiv_(params, exp_avgs, corrected, value=-lr / bias_correction1)
        return
    if not grad_accums:
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        m, denom = exp_avgs, list(torch._foreach_sqrt(exp_avg_sqs))
    else:
        m = list(torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1))
        denom = list(torch._foreach_mul(exp_avg_sqs, beta2))
        torch._foreach_addcmul_(denom, grads, grads, value=1.0 - beta2)
        torch._foreach_sqrt_(denom)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, m, denom, value=-lr / bias_correction1)
    if grad_accums:
        torch._foreach_add_(grad_accums, grads, alpha=1.0 / accum_steps)
        if t % accum_steps == 0:
            torch._foreach_lerp_(exp_avgs, grad_accums, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grad_accums, grad_accums, value=1.0 - beta2)
            torch._foreach_zero_(grad_accums)


CPU_CHUNK_ELEMENTS = 2**18
"""On CPU the foreach path works through slices of about this many elements (1 MiB of float32 per
tensor list), so its temporaries stay in cache and are reused instead of being allocated (and
page-faulted) at full model size every step. Elementwise math does not depend on the slicing."""


def _cpu_chunks(lists: list[list[Tensor]]) -> list[list[list[Tensor]]]:
    """Split parallel tensor lists into batches of flat slices of about CPU_CHUNK_ELEMENTS each.

    ``lists[j][i]`` are same-shaped tensors (a parameter and its state). On CUDA, or where a tensor is
    not contiguous, tensors are kept whole. Returns a list of batches, each shaped like ``lists``.
    """
    if lists[0][0].is_cuda:
        return [lists]
    batches: list[list[list[Tensor]]] = []
    current: list[list[Tensor]] = [[] for _ in lists]
    size = 0
    for i in range(len(lists[0])):
        group = [tensors[i] for tensors in lists]
        if all(t.is_contiguous() for t in group):
            pieces = [torch.split(t.view(-1), CPU_CHUNK_ELEMENTS) for t in group]
        else:
            pieces = [(t,) for t in group]
        for parts in zip(*pieces, strict=True):
            for j, part in enumerate(parts):
                current[j].append(part)
            size += parts[0].numel()
            if size >= CPU_CHUNK_ELEMENTS:
                batches.append(current)
                current, size = [[] for _ in lists], 0
    if size:
        batches.append(current)
    return batches


def _group_for_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    t_values: list[int],
    u_values: list[int],
    shared: list[Tensor | None],
) -> list[list[int]]:
    """Indices grouped so that each foreach call sees one device, one dtype, one step count, one
    count of group-gradient updates, and a shared second moment on all or none."""
    buckets: dict[tuple[torch.device, torch.dtype, torch.dtype, int, int, bool], list[int]] = {}
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        key = (param.device, param.dtype, grad.dtype, t_values[i], u_values[i], shared[i] is not None)
        buckets.setdefault(key, []).append(i)
    return list(buckets.values())
