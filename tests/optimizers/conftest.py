"""Fixtures of the optimizer tests: the backend switch and lockstep helpers.

``backend`` runs a test twice: through the ops' pure-PyTorch references and through their Triton
kernels (the interpreter on CPU). ``lockstep`` steps a culmen optimizer and a reference optimizer on
identical copies of the same params with the same fresh random gradients.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import pytest
import torch

# Odd sizes: a 1-element tensor, sizes around a 1024/2048 block and a tensor spanning two 8192 chunks.
ODD_SHAPES: tuple[tuple[int, ...], ...] = ((1,), (63,), (5, 123), (8192 + 7,), (2049,))


@pytest.fixture(params=["reference_backend", "triton_backend"])
def backend(request):
    request.getfixturevalue(request.param)
    return request.param.split("_")[0]


class Lockstep:
    """Helpers shared by the optimizer tests."""

    shapes = ODD_SHAPES

    @staticmethod
    def params(shapes: Sequence[tuple[int, ...]] = ODD_SHAPES, dtype=torch.float32, device="cpu",
               dtypes: Sequence[torch.dtype] | None = None) -> list[torch.Tensor]:
        dts = dtypes or [dtype] * len(shapes)
        return [torch.randn(s, device=device).to(dt).requires_grad_() for s, dt in zip(shapes, dts)]

    @staticmethod
    def copies(params: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        return [p.detach().to(dtype or p.dtype, copy=True).requires_grad_() for p in params]

    @staticmethod
    def grads(params: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
        return [(torch.randn(p.shape, device=p.device) * scale).to(p.dtype) for p in params]

    @staticmethod
    def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.detach().to(p.dtype, copy=True)

    def run(self, ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, a: list[torch.Tensor],
            b: list[torch.Tensor], steps: int = 7, frozen: Sequence[int] = (),
            grad_fn: Callable[[int], list[torch.Tensor]] | None = None) -> None:
        """``steps`` steps of both optimizers with the same random gradients (None for ``frozen``)."""
        for s in range(steps):
            gs = grad_fn(s) if grad_fn is not None else self.grads(a)
            gs = [None if i in frozen else g for i, g in enumerate(gs)]
            self.set_grads(a, gs)
            self.set_grads(b, gs)
            ours.step()
            ref.step()

    @staticmethod
    def assert_close(actual, expected, rtol=1e-5, atol=1e-5, what="") -> None:
        for i, (x, y) in enumerate(zip(actual, expected)):
            torch.testing.assert_close(x.detach().double(), y.detach().double(), rtol=rtol, atol=atol,
                                       msg=lambda m, i=i: f"{what}[{i}]: {m}")

    @staticmethod
    def roundtrip(state_dict: dict) -> dict:
        """``state_dict`` through ``torch.save`` / ``torch.load`` (what a checkpoint does)."""
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)


@pytest.fixture
def lockstep() -> Lockstep:
    return Lockstep()
