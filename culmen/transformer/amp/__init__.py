"""Mixed precision for model-parallel training (Apex's ``apex.transformer.amp``)."""

from culmen.transformer.amp.grad_scaler import GradScaler

__all__ = ["GradScaler"]
