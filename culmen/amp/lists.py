"""Apex's O1 cast lists, and how culmen applies them on top of ``torch.autocast``.

The first half of this module is data in Apex's terms: for each namespace Apex patched
(``torch``, ``torch.nn.functional``, ``torch.Tensor``) the names that O1 runs in 16-bit
(``FP16_FUNCS``), in fp32 (``FP32_FUNCS``), with type promotion (``CASTS``, ``SEQUENCE_CASTS``) and the
one banned function. The second half maps those names to ATen operators, which is where culmen
applies them: at the ``AutocastCPU`` / ``AutocastCUDA`` dispatch keys, filling only the gaps that
``torch.autocast`` itself leaves for the device (see :mod:`culmen.amp._cast_engine`).

Where culmen's O1 differs from Apex's, and why:

* Element-wise arithmetic and comparisons (``add``, ``mul``, ``__add__``, ``eq`` ...) are left to
  PyTorch's own type promotion, which gives the same result as Apex's cast-to-widest except when one
  operand is a 0-dim tensor (PyTorch then keeps the dimensioned operand's dtype). Intercepting every
  addition in Python would cost more than the rest of O1 together.
* Ops that ``torch.autocast`` added after Apex's lists were written (``einsum``,
  ``scaled_dot_product_attention``, RNN cells, ``linalg_vecdot`` ...) follow torch's policy.
* ``cross_entropy`` on CUDA is not recast: torch computes it as ``log_softmax`` + ``nll_loss``, both
  already run in fp32 by ``torch.autocast``, so the result is the same fp32 value as Apex's without an
  fp32 copy of the (often vocabulary-sized) logits.
* ``Tensor.cpu()`` of a 16-bit tensor returns fp32, as in Apex, only while casts are active.
"""

from __future__ import annotations

# --------------------------------------------------------------------------------- Apex's lists

TORCH_FP16_FUNCS: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
    "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm",
)
"""``torch.*`` functions O1 runs in 16-bit (Apex's ``torch_overrides.FP16_FUNCS``, CUDA >= 9.1)."""

TORCH_FP32_FUNCS: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm",
)
"""``torch.*`` functions O1 runs in fp32 (Apex's ``torch_overrides.FP32_FUNCS``)."""

TORCH_CASTS: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul",
    "eq", "equal", "ge", "gt", "le", "lt", "ne",
)
"""``torch.*`` functions whose floating inputs are promoted to the widest type (``torch_overrides.CASTS``)."""

TORCH_SEQUENCE_CASTS: tuple[str, ...] = ("cat", "stack")
"""``torch.*`` functions taking a sequence of tensors, promoted to the widest type."""

FUNCTIONAL_FP16_FUNCS: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "linear",
)
"""``torch.nn.functional.*`` functions O1 runs in 16-bit."""

FUNCTIONAL_FP32_FUNCS: tuple[str, ...] = (
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "layer_norm", "group_norm",
    "local_response_norm", "normalize", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss",
)
"""``torch.nn.functional.*`` functions O1 runs in fp32."""

FUNCTIONAL_BANNED_FUNCS: tuple[tuple[str, str], ...] = (
    ("binary_cross_entropy",
     "amp O1 refuses F.binary_cross_entropy / nn.BCELoss on 16-bit inputs: the probabilities it takes "
     "lose too much precision near 0 and 1 once an earlier op produced them in 16-bit. Use "
     "torch.nn.BCEWithLogitsLoss (sigmoid and BCE in one fp32-safe op) instead, or call "
     "amp.register_float_function(torch, 'sigmoid') before amp.initialize so the probabilities are fp32. "
     "To run it anyway (in fp32), pass allow_banned=True to amp.init()."),
)
"""Functions O1 refuses on 16-bit inputs unless ``allow_banned`` (message, in culmen's words)."""

TENSOR_FP16_FUNCS: tuple[str, ...] = ("__matmul__",)
"""``torch.Tensor`` methods O1 runs in 16-bit (plus every ``TORCH_FP16_FUNCS`` name that is a method)."""

TENSOR_FP32_FUNCS: tuple[str, ...] = ("__ipow__", "__pow__", "__rpow__", "cpu")
"""``torch.Tensor`` methods O1 runs in fp32 (plus every ``TORCH_FP32_FUNCS`` name that is a method)."""

TENSOR_CASTS: tuple[str, ...] = (
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__", "__isub__",
    "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__", "__rmul__", "__rsub__",
    "__rtruediv__", "__sub__", "__truediv__",
)
"""``torch.Tensor`` operators promoted to the widest type."""

# ------------------------------------------------------------------- the same lists as ATen ops

ATEN_LOWP: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
    "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm", "linear",
)
"""ATen ops behind the 16-bit lists (``__matmul__`` is ``matmul``; ``F.linear`` is ``linear``)."""

ATEN_FP32: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "cumprod", "cumsum", "dist", "prod", "std", "sum", "var", "renorm",
    # torch.norm / Tensor.norm
    "norm", "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm", "nuclear_norm",
    "softplus", "log_softmax", "softmax", "layer_norm", "group_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "cross_entropy_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "nll_loss2d",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss",
    # F.interpolate
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
)
"""ATen ops behind the fp32 lists (losses map to their ATen op, ``interpolate`` to upsample, ``norm`` to
the ``linalg`` norms it calls)."""

ATEN_INPLACE_ERROR: tuple[str, ...] = tuple(f"{n}_" for n in TORCH_FP32_FUNCS)
"""In-place forms of the fp32 functions (``Tensor.exp_`` ...): on a 16-bit tensor Apex's O1 raises
``NotImplementedError`` (the result could not be kept in fp32); on fp32 tensors they run."""

ATEN_FP32_OVERRIDE: tuple[str, ...] = ("grid_sampler",)
"""fp32 in Apex but promoted by ``torch.autocast`` on CUDA: culmen replaces torch's policy."""

ATEN_PROMOTE: tuple[str, ...] = ("addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "equal", "cat", "stack")
"""ATen ops of the promote lists that PyTorch's native type promotion does not already cover."""

ATEN_BANNED: tuple[str, ...] = ("binary_cross_entropy",)
"""ATen ops of the banned list (replaces torch's own policy on every device)."""

ATEN_SKIP: dict[str, tuple[str, ...]] = {
    # log_softmax + nll_loss are already fp32 under torch.autocast on CUDA (see the module docstring).
    "cuda": ("cross_entropy_loss",),
}
"""Per device type, ATen ops of the lists that culmen leaves to torch's decomposition."""

PYTHON_FP32: tuple[tuple[str, str], ...] = (
    ("torch.nn.functional", "softmin"),
    ("torch.nn.functional", "local_response_norm"),
    ("torch.nn.functional", "normalize"),
    ("torch.nn.functional", "multilabel_soft_margin_loss"),
)
"""fp32 functions that are Python compositions with no ATen op of their own: patched in Python."""
