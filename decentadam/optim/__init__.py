"""Local optimizers (no communication)."""

from decentadam.optim.accum_adamw import AccumAdamW, accum_adamw

__all__ = ["AccumAdamW", "accum_adamw"]
