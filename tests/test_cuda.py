"""The CUDA paths: the optimizer on GPU tensors, exchanges of GPU buckets, NCCL, fp16/bf16 with Accelerate.

Skipped without a CUDA device (CI has none); run them on a GPU machine with ``pytest tests/test_cuda.py``.
NCCL needs one GPU per rank, so on a single GPU the multi-rank test exchanges CUDA tensors over gloo
(several processes sharing the device) and NCCL is checked with one rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from decentadam import AccumAdamW, Comm, DecentralizedAdam, Setting
from decentadam.collectives import ProcessGroupCommunicator
from tests.distributed_harness import free_port, run_distributed
from tests.test_decentralized import STEPS, batch, flat, make_model, param_groups, simulate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LR, BETAS, EPS = 3e-2, (0.9, 0.999), 1e-8


def random_params(seed: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (1000,), (7, 3, 5)]
    return [torch.randn(s, generator=generator, dtype=torch.float64).to(device) for s in shapes]


def run_optimizer(make: Any, device: str, steps: int = 20) -> list[torch.Tensor]:
    params = [p.requires_grad_() for p in random_params(0, device)]
    optimizer = make(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(device)
        optimizer.step()
    return [p.detach().cpu() for p in params]


def test_accum_adamw_on_cuda_equals_adamw_and_the_for_loop() -> None:
    kwargs: dict[str, Any] = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.1}
    adamw = run_optimizer(lambda p: torch.optim.AdamW(p, foreach=True, **kwargs), "cuda")
    ours = run_optimizer(lambda p: AccumAdamW(p, accum_steps=1, foreach=True, **kwargs), "cuda")
    for a, b in zip(adamw, ours, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-13)
    foreach = run_optimizer(lambda p: AccumAdamW(p, accum_steps=4, foreach=True, **kwargs), "cuda")
    loop = run_optimizer(lambda p: AccumAdamW(p, accum_steps=4, foreach=False, **kwargs), "cuda")
    cpu = run_optimizer(lambda p: AccumAdamW(p, accum_steps=4, foreach=True, **kwargs), "cpu")
    for f, lp, c in zip(foreach, loop, cpu, strict=True):
        torch.testing.assert_close(f, lp, rtol=0, atol=1e-13)
        torch.testing.assert_close(f, c, rtol=0, atol=1e-12)


def cuda_worker(rank: int, world_size: int, name: str, local_world_size: int) -> torch.Tensor:
    model = make_model(seed=100 + rank).cuda()
    optimizer = DecentralizedAdam(
        param_groups(model),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        accum_steps=4,
        setting=Setting(second_moment="local", topology=name),
        comm=Comm(local_world_size=local_world_size, bucket_size_mb=1e-4),
    )
    assert all(b.buffer.is_cuda for b in optimizer.buckets)
    # CUDA buckets never take the CPU-only three phases, so their process groups are not built
    assert isinstance(optimizer.communicator, ProcessGroupCommunicator)
    assert not optimizer.communicator.hierarchical and not optimizer.communicator.hierarchical_groups
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        optimizer.step()
    return flat(model).cpu()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "local_world_size"), [("ring", 1), ("aer", 2)])
def test_cuda_buckets_match_the_simulation(name: str, local_world_size: int) -> None:
    per_rank = run_distributed(cuda_worker, 4, name, local_world_size, timeout_s=240)
    expected = simulate(name, 4, local_world_size, 4)
    torch.testing.assert_close(torch.stack(per_rank), expected, rtol=0, atol=1e-10)


def test_nccl_process_group_single_rank(tmp_path: Path) -> None:
    """DecentralizedAdam and a checkpoint under an NCCL default process group (one GPU: one rank)."""
    script = tmp_path / "nccl.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from decentadam import Comm, DecentralizedAdam, Setting\n"
        "from decentadam.checkpoint import save_checkpoint, load_checkpoint\n"
        "dist.init_process_group('nccl')\n"
        "torch.cuda.set_device(0)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))\n"
        "model = model.cuda()\n"
        "opt = DecentralizedAdam(model.parameters(), lr=1e-2, setting=Setting(topology='aer'), "
        "comm=Comm(timeout=30.0))\n"
        "x, y = torch.randn(64, 16, device='cuda'), torch.randn(64, 4, device='cuda')\n"
        "losses = []\n"
        "for _ in range(20):\n"
        "    opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()\n"
        "    losses.append(loss.item())\n"
        "assert losses[-1] < losses[0], losses\n"
        "assert opt.consensus_distance() == 0.0\n"
        f"save_checkpoint({str(tmp_path / 'ckpt')!r}, model, opt)\n"
        f"load_checkpoint({str(tmp_path / 'ckpt')!r}, model, opt)\n"
        "print('ok', losses[0], losses[-1])\n"
        "dist.destroy_process_group()\n"
    )
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    process = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert process.returncode == 0, process.stdout + process.stderr
    assert process.stdout.startswith("ok")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accelerate_mixed_precision_on_cuda(precision: str) -> None:
    """Accelerate's autocast and (fp16) its CUDA loss scaler, replaced by the synced one."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from decentadam.amp import SyncedGradScaler
    from decentadam.integrations.accelerate import prepare

    AcceleratorState._reset_state(reset_partial_state=True)  # one process runs both precisions
    accelerator = Accelerator(mixed_precision=precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)).to(accelerator.device)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    optimizer = DecentralizedAdam(model.parameters(), lr=1e-2, setting=Setting(topology="ring"))
    model, optimizer = prepare(accelerator, model, optimizer)
    if precision == "fp16":
        assert isinstance(accelerator.scaler, SyncedGradScaler)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 2, device="cuda")
    skipped = []
    for step in range(4):
        loss = nn.functional.mse_loss(model(x).float(), y)
        if step == 1 and precision == "fp16":
            loss = loss * float("inf")
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(bool(optimizer.step_was_skipped))
    assert seen and set(seen) == {torch.float16 if precision == "fp16" else torch.bfloat16}
    assert skipped == ([False, True, False, False] if precision == "fp16" else [False] * 4)
    assert optimizer.optimizer.step_count == (3 if precision == "fp16" else 4)
    assert all(torch.isfinite(p).all() for p in model.parameters())
