"""Apex's ``apex.transformer.enums``: the model, layer and attention-mask kinds Megatron-style code passes."""

import enum

__all__ = ["AttnMaskType", "AttnType", "LayerType", "ModelType"]


class LayerType(enum.Enum):
    """Transformer layer kind."""

    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    """Attention kind: self (q, k, v from one input) or cross (k, v from the encoder)."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Attention mask kind of ``FusedScaleMaskSoftmax``: an explicit padding mask, or causal
    (upper-triangular, GPT)."""

    padding = 1
    causal = 2


class ModelType(enum.Enum):
    """Pipeline model kind: one stack (GPT/BERT) or an encoder and a decoder (T5)."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
