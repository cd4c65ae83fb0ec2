"""Megatron-style batch samplers (Apex's ``apex.transformer._data``)."""

from culmen.transformer._data._batchsampler import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

__all__ = ["MegatronPretrainingRandomSampler", "MegatronPretrainingSampler"]
