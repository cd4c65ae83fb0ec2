"""Convolution epilogues (per-channel scale and bias, residual, mask, ReLU) in Triton, with a PyTorch reference.

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached call plan ``EpiloguePlan`` (validation,
layout, tiles, bound launches) in ``launch.py``; the references ``conv_epilogue_fwd_ref`` /
``conv_epilogue_bwd_ref`` in ``reference.py``; the entry point ``conv_epilogue``, its autograd and
``epilogue_plan`` in ``op.py``. The convolutions themselves run in PyTorch (cuDNN); this family fuses what
follows them into one pass forward and one pass backward.
"""

from culmen.ops.conv_epilogue.op import conv_epilogue, epilogue_plan
from culmen.ops.conv_epilogue.reference import conv_epilogue_bwd_ref, conv_epilogue_fwd_ref

__all__ = ["conv_epilogue", "conv_epilogue_bwd_ref", "conv_epilogue_fwd_ref", "epilogue_plan"]
