"""``apex.contrib.clip_grad``: :func:`clip_grad_norm_` with a multi-tensor norm and no host sync."""

from culmen.contrib.clip_grad.clip_grad import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
