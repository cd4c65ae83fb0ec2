"""Helpers for the outputs of ``torch.library`` custom ops."""

import torch


def nothing(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh 0-element tensor standing for an absent output.

    Custom ops cannot return ``None`` and their outputs may not alias each other, so every absent
    output gets its own empty tensor.
    """
    return torch.empty(0, device=device, dtype=dtype)
