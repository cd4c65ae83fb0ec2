"""Exact fp32 emulation helpers for the optimizer rounding tests: float64 tensors carry fp32 values, each
operation of the emulated PyTorch kernel rounds once to fp32, so a Triton kernel can be held to a few ulps of
what torch's CUDA fp32 step computes."""

from __future__ import annotations

import math

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


def ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in fp32 ulps of ``expected``."""
    e = expected.float()
    ulp = (torch.nextafter(e.abs(), torch.tensor(math.inf, device=e.device)) - e.abs()).double()
    return (actual.double() - expected.double()).abs() / ulp


def check_ulps(history, max_ulps: float, min_identical: float) -> None:
    """Every step of ``history`` (``[(ours, ref)]`` lists of tensors) within ``max_ulps`` and at least a
    ``min_identical`` fraction of the elements bit-identical."""
    for k, (ours, ref) in enumerate(history):
        d = torch.cat([ulps(a.reshape(-1), b.reshape(-1)) for a, b in zip(ours, ref)])
        assert d.max().item() <= max_ulps, f"step {k + 1}: {d.max().item()} ulps"
        same = (d == 0).double().mean().item()
        assert same >= min_identical, f"step {k + 1}: only {same:.4f} of the elements bit-identical"
