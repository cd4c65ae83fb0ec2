"""Exact fp32 emulation helpers for the optimizer rounding tests: float64 tensors carry fp32 values, each
operation of the emulated PyTorch kernel rounds once to fp32, so a Triton kernel can be held to a few ulps of
what torch's CUDA fp32 step computes."""

from __future__ import annotations

import torch

SHAPES = ((1,), (37, 19), (2049,), (3, 1001))  # odd sizes: 1 element, around a 2048 block, several blocks


def r32(x: torch.Tensor) -> torch.Tensor:
    """Round a float64 tensor to fp32 (kept as float64): one IEEE fp32 rounding."""
    return x.float().double()


def s32(x: float) -> float:
    """A Python scalar as torch hands it to an fp32 kernel: rounded to fp32."""
    return float(torch.tensor(x, dtype=torch.float32))


def fma32(a, b, c) -> torch.Tensor:
    """``a * b + c`` rounded once to fp32 (the fp32 product is exact in float64; the float64 sum then fp32
    rounding is a double rounding, off by an ulp only in rare ties)."""
    return r32(a * b + c)
