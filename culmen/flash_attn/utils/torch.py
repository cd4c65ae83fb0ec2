"""flash_attn's ``flash_attn.utils.torch``: ``custom_fwd`` / ``custom_bwd``, the autocast decorators of
``torch.amp`` bound to ``device_type="cuda"``, usable bare (``@custom_fwd``) or with arguments
(``@custom_fwd(cast_inputs=torch.float16)``), as flash_attn's modules use them."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["custom_amp_decorator", "custom_bwd", "custom_fwd"]


def custom_amp_decorator(dec: Callable, cuda_amp_deprecated: bool) -> Callable:
    """``dec`` (``torch.amp.custom_fwd`` / ``custom_bwd``) with ``device_type="cuda"`` filled in when
    ``cuda_amp_deprecated`` (the ``torch.amp`` form, which needs it; the old ``torch.cuda.amp`` form did not)."""

    def decorator(*args, **kwargs):
        if cuda_amp_deprecated:
            kwargs["device_type"] = "cuda"
        return dec(*args, **kwargs)

    return decorator


custom_fwd = custom_amp_decorator(torch.amp.custom_fwd, True)
custom_bwd = custom_amp_decorator(torch.amp.custom_bwd, True)
