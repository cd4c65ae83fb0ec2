"""flash_attn's ``flash_attn.models`` on culmen: ``gpt`` (``GPTModel``, ``GPTLMHeadModel``, tensor-parallel
state-dict sharding and the GPT-2 / Megatron checkpoint remaps) and the other model families beside it.

Every model is built from ``culmen.flash_attn.modules`` with flash_attn's parameter names, so flash_attn
checkpoints load unchanged.
"""
