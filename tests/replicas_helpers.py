"""Models and helpers shared by the replica tests (imported by spawned ranks too).

``TinyTP`` is one rank's piece of a tensor-parallel transformer-ish model with odd sizes: a position
embedding, two blocks of (LayerNorm, column-parallel up, row-parallel down) and a final LayerNorm.
Sharded tensors are marked the way Paddle (``is_distributed``) and Megatron (``tensor_model_parallel``)
mark them, so the default selection must leave them out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from shardsync.errors import ReplicaError
from shardsync.replicas import tp_sharding

__all__ = [
    "TinyTP",
    "REPLICATED",
    "fill",
    "gather",
    "count_collectives",
    "mixed_precision",
    "mp_step",
    "H",
    "F",
    "replica_error",
]

H, F, SEQ = 17, 7, 5  # hidden size, per-rank FFN shard, positions

#: The replicated parameters of TinyTP, sorted (what the default selection must find).
REPLICATED = (
    "blocks.0.down.bias",
    "blocks.0.ln.bias",
    "blocks.0.ln.weight",
    "blocks.1.down.bias",
    "blocks.1.ln.bias",
    "blocks.1.ln.weight",
    "norm.bias",
    "norm.weight",
    "pos_embedding",
)


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all_reduce SUM backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """all_reduce SUM forward, identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


class Block(nn.Module):
    def __init__(self, tp: bool) -> None:
        super().__init__()
        self.tp = tp
        self.ln = nn.LayerNorm(H)
        self.up = nn.Linear(H, F)  # column-parallel: weight and bias sharded
        self.down = nn.Linear(F, H)  # row-parallel: weight sharded, bias replicated
        self.up.weight.tensor_model_parallel = True
        self.up.bias.is_distributed = True
        self.down.weight.is_distributed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if self.tp:
            h = _CopyToTP.apply(h)
        h = torch.relu(self.up(h)) @ self.down.weight.t()
        if self.tp:
            h = _ReduceFromTP.apply(h)
        return x + h + self.down.bias


class TinyTP(nn.Module):
    def __init__(self, tp: bool = False) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.zeros(SEQ, H))
        self.blocks = nn.ModuleList([Block(tp), Block(tp)])
        self.norm = nn.LayerNorm(H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos_embedding
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def fill(model: nn.Module, rank: int = 0, sharded_differs: bool = True) -> None:
    """Deterministic arange-based values, exact in bf16; sharded tensors differ per rank."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            base = (torch.arange(p.numel(), dtype=torch.float32) % 13 - 6) * 0.125 + 0.0625 * (i % 3)
            sharded = tp_sharding(p) is not None  # (torch.Tensor.is_distributed is a method)
            if sharded and sharded_differs:
                base = base + 0.25 * rank
            p.copy_(base.reshape(p.shape))


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (as float64 on CPU)."""
    t = t.detach().to(torch.float64).contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


@contextmanager
def count_collectives() -> Iterator[list[str]]:
    """Record every dist.all_reduce / dist.broadcast call made through the torch.distributed module."""
    calls: list[str] = []
    real = {n: getattr(dist, n) for n in ("all_reduce", "broadcast")}

    def wrap(n):
        def f(*a, **k):
            calls.append(n)
            return real[n](*a, **k)

        return f

    for n in real:
        setattr(dist, n, wrap(n))
    try:
        yield calls
    finally:
        for n, f in real.items():
            setattr(dist, n, f)


def mixed_precision(model: nn.Module, lr: float = 0.01) -> tuple[dict, torch.optim.Optimizer]:
    """bf16 model params, fp32 masters held by AdamW (the documented mixed-precision convention)."""
    model.to(torch.bfloat16)
    masters = {p: p.detach().float().clone().requires_grad_(True) for p in model.parameters()}
    return masters, torch.optim.AdamW(list(masters.values()), lr=lr)


def mp_step(model: nn.Module, masters: dict, opt: torch.optim.Optimizer, x: torch.Tensor, before_step=None) -> None:
    """One mixed-precision step: bf16 backward, grads to the masters, step, re-derive params."""
    model(x.to(torch.bfloat16)).float().square().mean().backward()
    for p, m in masters.items():
        m.grad = None if p.grad is None else p.grad.float()
        p.grad = None
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, m in masters.items():
            p.copy_(m)


def replica_error(fn: Callable[[], object]) -> tuple[str, str]:
    """``("ReplicaError", message)`` if ``fn()`` raises one, else ``("no error", "")`` (spawned ranks
    return it, so each test can assert its own part)."""
    try:
        fn()
    except ReplicaError as exc:
        return ("ReplicaError", str(exc))
    return ("no error", "")
