"""Hugging Face ``transformers`` on culmen's kernels, in one import.

Importing this module registers culmen's attention as ``attn_implementation="culmen"``
(:func:`register`, idempotent), so::

    import culmen.integrations.huggingface as culmen_hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="culmen")
    report = culmen_hf.patch(model)  # RMSNorm / LayerNorm, rotary, MLP activations, fused linear + CE loss
    print(report)

* :mod:`culmen.integrations.hf_attention`: the attention function, the mask function and
  :func:`register` (padded batches, sliding windows, softcap, GQA, ``DynamicCache`` / ``StaticCache``).
* :mod:`culmen.integrations.hf_patch`: :func:`patch` and :class:`PatchReport`.

Needs ``transformers`` 5 (importing this module imports it).
"""

from __future__ import annotations

from culmen.integrations.hf_attention import (
    ATTN_IMPLEMENTATION,
    culmen_attention_forward,
    culmen_attention_mask,
    is_registered,
    register,
)
from culmen.integrations.hf_patch import CulmenActivation, PatchReport, culmen_apply_rotary_pos_emb, patch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CulmenActivation",
    "PatchReport",
    "culmen_apply_rotary_pos_emb",
    "culmen_attention_forward",
    "culmen_attention_mask",
    "is_registered",
    "patch",
    "register",
]

register()
