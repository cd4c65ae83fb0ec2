"""``patch(model)``: culmen's fused kernels swapped into a Hugging Face ``transformers`` model in place.

The patch recognises module *structure and behaviour*, not a list of class names per model, so one
function serves LLaMA, Mistral, Qwen2/3, Gemma 1-3, Phi-3, GPT-2, GPT-NeoX, OPT and models built like them:

* **RMSNorm**: a parameter-free-but-``weight`` leaf with an ``eps`` / ``variance_epsilon`` attribute whose
  forward, probed on a small CPU copy with a random weight, is ``w * x / rms(x)`` (LLaMA) or
  ``(1 + w) * x / rms(x)`` (Gemma's zero-centred weight), and whose output dtype follows the LLaMA
  (``promote(x, w)``) or Gemma (``x``'s) convention -> ``culmen.flash_attn.ops.triton.layer_norm.rms_norm_fn``
  (fp32 statistics, one rounding). Qwen3's / Gemma3's per-head ``q_norm`` / ``k_norm`` are found the same way.
* **LayerNorm**: ``torch.nn.LayerNorm`` with its own forward -> ``layer_norm_fn``. Under autocast the
  output keeps the input's dtype (``F.layer_norm`` would return fp32), as Apex's fused LayerNorm does.
* **Rotary**: an attention module whose forward calls the module-level ``apply_rotary_pos_emb`` gets a
  copy of that forward that calls culmen's rotary kernel instead (``culmen.ops.rotary``, NeoX halves,
  partial rotary dims pass through), after the model's own function and culmen's agreed on a probe.
  Only the patched model's modules change: other models of the same class keep transformers' function.
* **Gated MLP**: ``gate_proj`` / ``up_proj`` / ``down_proj`` (or Phi-3's fused ``gate_up_proj`` /
  ``down_proj``) with a SiLU or GELU activation, whose forward the probe confirms is
  ``down(act(gate(x)) * up(x))`` -> ``culmen.ops.activations.gated_act`` (SwiGLU / GeGLU in one pass).
* **Activations**: a ``torch.nn`` / ``transformers.activations`` module that the probe identifies as exact
  GELU, tanh GELU, SiLU, ReLU or sigmoid (GPT-2's ``gelu_new``, GPT-NeoX's ``gelu``, OPT's ``relu``) ->
  :class:`CulmenActivation` (``culmen.ops.activations.bias_act``).
* **Causal-LM loss**: a model with a linear output embedding and a ``labels`` argument: with ``labels`` in
  training mode, the LM head is not run; the hidden states go to
  ``culmen.ops.cross_entropy.fused_linear_cross_entropy`` (the ``(tokens, vocab)`` logits are never
  formed; Gemma 2/3's ``final_logit_softcapping`` is applied inside), the loss is transformers' (labels
  shifted, ``ignore_index=-100``, mean over counted tokens or sum / ``num_items_in_batch``) and
  ``logits`` is ``None`` in the output, as Liger-Kernel does. Without labels, or in eval mode, the model
  runs as before and returns logits.
* **Attention**: ``attn_implementation="culmen"`` (:mod:`culmen.integrations.hf_attention`).

Modules are patched by swapping their class for a subclass with the same name whose ``forward`` calls
culmen (parameters, buffers, ``state_dict`` keys, hooks and ``isinstance`` are unchanged), or, for
parameter-free activations, by replacing the module. Anything not recognised is left as it is and
listed in the :class:`PatchReport`. Patching twice changes nothing more.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from culmen.flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn
from culmen.ops.activations import bias_act, gated_act
from culmen.ops.cross_entropy import fused_linear_cross_entropy
from culmen.ops.rotary import rotary

__all__ = ["CulmenActivation", "PatchReport", "culmen_apply_rotary_pos_emb", "patch"]

KINDS = ("rms_norm", "layer_norm", "rotary", "mlp", "activation", "cross_entropy", "attention")


@dataclass
class PatchReport:
    """What :func:`patch` did.

    Attributes:
        counts: modules patched per kind (``KINDS``; ``rotary`` counts attention modules, ``cross_entropy``
            the model itself), this call only.
        already_patched: modules that an earlier ``patch`` had already patched, per kind.
        unrecognized: module type name -> number of modules left alone that hold parameters or compute
            something (not a container, linear, embedding, dropout or rotary-table module).
        notes: why candidates were left alone (a probe that disagreed, a model whose logits are rescaled).
    """

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    already_patched: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    unrecognized: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Modules patched by this call."""
        return sum(self.counts.values())

    def __str__(self) -> str:
        done = ", ".join(f"{k}={v}" for k, v in self.counts.items() if v)
        before = ", ".join(f"{k}={v}" for k, v in self.already_patched.items() if v)
        left = ", ".join(f"{k} x{v}" for k, v in sorted(self.unrecognized.items()))
        lines = [f"culmen patch: {done or 'nothing'}"]
        if before:
            lines.append(f"  already patched: {before}")
        if left:
            lines.append(f"  left alone: {left}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- class swapping

_SUBCLASSES: dict[tuple[type, str], type] = {}


def _kind_of(module: nn.Module) -> str | None:
    return type(module).__dict__.get("_culmen_kind")


def _swap(module: nn.Module, kind: str, namespace: dict) -> None:
    """Give ``module`` a cached subclass of its class (same name) with ``namespace`` (its ``forward``)."""
    cls = type(module)
    sub = _SUBCLASSES.get((cls, kind))
    if sub is None:
        sub = type(cls.__name__, (cls,), {"_culmen_kind": kind, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, **namespace})
        _SUBCLASSES[(cls, kind)] = sub
    module.__class__ = sub


# ----------------------------------------------------------------------------------------------- norms

_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def _rms_forward(self, *args, **kwargs) -> Tensor:
    x = args[0] if args else next(iter(kwargs.values()))
    out_dtype = x.dtype if self._culmen_keep_dtype else torch.promote_types(x.dtype, self.weight.dtype)
    return rms_norm_fn(x, self.weight, None, eps=self._culmen_eps, zero_centered_weight=self._culmen_zc,
                       out_dtype=out_dtype)


def _ln_forward(self, *args, **kwargs) -> Tensor:
    x = args[0] if args else next(iter(kwargs.values()))
    return layer_norm_fn(x, self.weight, self.bias, eps=self.eps)


def _rms_candidate(module: nn.Module) -> float | None:
    """The eps of a leaf whose only tensor state is a 1-D ``weight`` (an RMSNorm by shape), else None."""
    w = module._parameters.get("weight")
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or module._modules or module._buffers:
        return None
    if any(p is not None for n, p in module._parameters.items() if n != "weight"):
        return None
    for name in _EPS_NAMES:
        eps = getattr(module, name, None)
        if isinstance(eps, float) and not isinstance(eps, bool):
            return eps
    return None


def _probe_rms(module: nn.Module, eps: float) -> tuple[bool, bool] | None:
    """``(zero_centered, keeps_input_dtype)`` when ``module`` behaves as an RMSNorm with ``eps``, else None.
    Runs a CPU fp32 copy of the module with a random weight (so the ``w`` and ``1 + w`` forms differ) on
    inputs of two scales (so a wrong ``eps`` shows)."""
    if module.weight.is_meta:
        return None
    try:
        probe = copy.deepcopy(module).to("cpu", torch.float32)
    except Exception:
        return None
    n = probe.weight.shape[0]
    gen = torch.Generator().manual_seed(1234)
    w = torch.randn(n, generator=gen, dtype=torch.float64)
    x = torch.randn(3, n, generator=gen, dtype=torch.float64) * torch.tensor([[1.0], [1e-3], [30.0]],
                                                                               dtype=torch.float64)
    with torch.no_grad():
        probe.weight.copy_(w)
        try:
            y = probe(x.float()).double()
            y16 = probe(x.to(torch.bfloat16))
        except Exception:
            return None
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    for zc, scale in ((False, w), (True, 1.0 + w)):
        if torch.allclose(y, normed * scale, rtol=1e-4, atol=1e-5):
            if y16.dtype not in (torch.bfloat16, torch.float32):
                return None
            return zc, y16.dtype == torch.bfloat16
    return None


# ------------------------------------------------------------------------------------------ activations

_ACT_MODULES = ("torch.nn.modules.activation", "transformers.activations")
_ACT_FORMULAS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
}


class CulmenActivation(nn.Module):
    """An elementwise activation run by culmen's fused kernel (``culmen.ops.activations.bias_act``).

    Args:
        activation: ``"gelu"`` (exact), ``"gelu_tanh"``, ``"silu"``, ``"relu"`` or ``"sigmoid"``.
        original: the module it replaces (kept for ``repr`` and for undoing the patch by hand).

    ``forward(x)``: ``x (..., N)`` fp16/bf16/fp32; returns ``act(x)`` in ``x``'s dtype (fp32 math).
    """

    _culmen_kind = "activation"

    def __init__(self, activation: str, original: nn.Module | None = None) -> None:
        super().__init__()
        if activation not in _ACT_FORMULAS:
            raise ValueError(f"activation must be one of {sorted(_ACT_FORMULAS)}, got {activation!r}")
        self.activation = activation
        self.__dict__["original"] = original  # not a submodule: state_dict and parameters stay the model's

    def forward(self, x: Tensor) -> Tensor:
        return bias_act(x, None, self.activation)

    def extra_repr(self) -> str:
        return f"{self.activation!r}, replaces={type(self.original).__name__ if self.original else None}"


def _probe_act(module: nn.Module) -> str | None:
    """The culmen activation name ``module`` computes (checked on a CPU grid of values), else None."""
    if type(module).__module__ not in _ACT_MODULES or module._parameters or module._modules:
        return None
    x = torch.linspace(-8.0, 8.0, 257)
    try:
        with torch.no_grad():
            y = module(x.clone())
    except Exception:
        return None
    if not isinstance(y, Tensor) or y.shape != x.shape:
        return None
    for name, fn in _ACT_FORMULAS.items():
        if torch.allclose(y, fn(x), rtol=1e-5, atol=1e-6):
            return name
    return None


# ------------------------------------------------------------------------------------------- gated MLPs


def _gated_forward(self, *args, **kwargs) -> Tensor:
    x = args[0] if args else next(iter(kwargs.values()))
    return self.down_proj(gated_act(self.gate_proj(x), self.up_proj(x), self._culmen_act))


def _gate_up_forward(self, *args, **kwargs) -> Tensor:
    x = args[0] if args else next(iter(kwargs.values()))
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(gated_act(gate, up, self._culmen_act))


def _mlp_parts(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(layout, activation module)`` of a gated MLP by its children, else None."""
    kids = module._modules
    if not isinstance(kids.get("down_proj"), nn.Linear):
        return None
    acts = [m for m in kids.values() if type(m).__module__ in _ACT_MODULES and not m._parameters]
    if len(acts) != 1:
        return None
    if isinstance(kids.get("gate_proj"), nn.Linear) and isinstance(kids.get("up_proj"), nn.Linear):
        return "gated", acts[0]
    if isinstance(kids.get("gate_up_proj"), nn.Linear):
        return "gate_up", acts[0]
    return None


def _probe_mlp(module: nn.Module, layout: str, act: nn.Module) -> bool:
    """Whether ``module``'s own forward equals ``down(act(gate(x)) * up(x))`` on a small random input."""
    down = module.down_proj
    first = module.gate_proj if layout == "gated" else module.gate_up_proj
    w = first.weight
    if w.is_meta:
        return False
    gen = torch.Generator().manual_seed(4321)
    x = torch.randn(3, first.in_features, generator=gen).to(w.device, w.dtype)
    with torch.no_grad():
        try:
            y = module(x)
        except Exception:
            return False
        if layout == "gated":
            ref = down(act(module.gate_proj(x)) * module.up_proj(x))
        else:
            g, u = module.gate_up_proj(x).chunk(2, dim=-1)
            ref = down(act(g) * u)
    tol = 1e-5 if w.dtype in (torch.float32, torch.float64) else 2e-2
    return isinstance(y, Tensor) and y.shape == ref.shape and torch.allclose(y.float(), ref.float(), rtol=tol,
                                                                             atol=tol)


# ------------------------------------------------------------------------------------------------- rotary

_OFFSETS: dict[tuple, Tensor] = {}


def _row_offsets(batch: int, seqlen: int, device: torch.device) -> Tensor:
    key = (batch, seqlen, device)
    t = _OFFSETS.get(key)
    if t is None:
        if len(_OFFSETS) > 64:
            _OFFSETS.clear()
        t = _OFFSETS[key] = torch.arange(batch, dtype=torch.int32, device=device) * seqlen
    return t


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF-layout ``x (B, h, S, D)`` rotated by per-row tables ``cos``/``sin`` ``(B or 1, S, rd)``."""
    B, _, S, _ = x.shape
    xs = x.transpose(1, 2)  # (B, S, h, D): the layout the projection wrote, usually contiguous
    if cos.shape[0] == 1:
        out = rotary(xs, cos[0], sin[0], full_table=True)
    else:
        # One table row per (batch row, position): rows b * S + s, reached through per-row offsets.
        out = rotary(xs, cos.reshape(B * S, -1), sin.reshape(B * S, -1), full_table=True,
                     seqlen_offsets=_row_offsets(B, S, x.device))
    return out.transpose(1, 2)


def _rotary_takes(q: Tensor, k: Tensor, cos: Tensor, unsqueeze_dim: int) -> bool:
    # ``type(...) is int``: some models' versions take ``position_ids`` in that place (passed positionally).
    return (type(unsqueeze_dim) is int and unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4
            and cos.dim() == 3 and cos.shape[1] == q.shape[2]
            and k.shape[2] == q.shape[2] and cos.shape[0] in (1, q.shape[0]))


def culmen_apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                                unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (NeoX halves, ``rotary_dim = cos.shape[-1] <= head_dim``, the
    other columns unchanged) on culmen's rotary kernel.

    Args:
        q: ``(B, h, S, D)``; k: ``(B, hk, S, D)``; cos, sin: ``(B or 1, S, rotary_dim)`` as transformers'
            rotary embedding modules return them (both halves equal); any float dtypes.
        unsqueeze_dim: must be 1 (the head dim of ``q``/``k``).

    Returns ``(q_embed, k_embed)`` of ``q``'s / ``k``'s shapes and dtypes (fp32 math). Raises ``ValueError``
    for other layouts.
    """
    if not _rotary_takes(q, k, cos, unsqueeze_dim):
        raise ValueError(f"culmen_apply_rotary_pos_emb: q (B, h, S, D), k (B, hk, S, D) and cos (B or 1, S, rd) "
                         f"with unsqueeze_dim=1 expected, got q {tuple(q.shape)}, k {tuple(k.shape)}, cos "
                         f"{tuple(cos.shape)}, unsqueeze_dim={unsqueeze_dim}")
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotary_for(original):
    """A drop-in for a model module's ``apply_rotary_pos_emb`` that falls back to ``original`` for layouts
    culmen's kernel does not take."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or not _rotary_takes(q, k, cos, unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    apply_rotary_pos_emb.culmen_original = original
    return apply_rotary_pos_emb


_ROTARY_OK: dict[object, object] = {}  # the model module's function -> its culmen drop-in, or None


def _probe_rotary(fn, head_dim: int) -> object | None:
    """culmen's drop-in for ``fn`` when they agree on random full and half-width tables, else None."""
    if fn in _ROTARY_OK:
        return _ROTARY_OK[fn]
    drop_in = _rotary_for(fn)
    gen = torch.Generator().manual_seed(99)
    ok = True
    for rd in (head_dim, head_dim // 2 - (head_dim // 2) % 2):
        if rd < 2:
            continue
        q = torch.randn(2, 3, 5, head_dim, generator=gen)
        k = torch.randn(2, 1, 5, head_dim, generator=gen)
        ang = torch.randn(2, 5, rd // 2, generator=gen)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        try:
            want = fn(q, k, cos, sin)
        except Exception:
            if rd == head_dim:
                ok = False
            continue  # a model without partial rotary may reject narrow tables
        got = drop_in(q, k, cos, sin)
        ok = ok and all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(want, got))
    _ROTARY_OK[fn] = drop_in if ok else None
    return _ROTARY_OK[fn]


def _unwrap_chain(fn) -> list:
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    return chain


def _rebuild(fn, globals_: dict):
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return new


def _forward_with(forward, name: str, replacement):
    """A copy of ``forward`` whose innermost function sees ``replacement`` as the global ``name``; decorator
    layers (``functools.wraps`` wrappers holding the next function in a closure cell) are rebuilt around it.
    None when ``forward`` does not look the name up as a global."""
    chain = _unwrap_chain(forward)
    inner = chain[-1]
    if not isinstance(inner, types.FunctionType) or name not in inner.__code__.co_names:
        return None
    g = dict(inner.__globals__)
    g[name] = replacement
    new = _rebuild(inner, g)
    for wrapper, old in zip(reversed(chain[:-1]), reversed(chain[1:])):
        if not isinstance(wrapper, types.FunctionType) or not wrapper.__closure__:
            return None
        cells = [types.CellType(new) if c.cell_contents is old else c for c in wrapper.__closure__]
        if all(a is b for a, b in zip(cells, wrapper.__closure__)):
            return None
        w = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__,
                               tuple(cells))
        w.__kwdefaults__ = wrapper.__kwdefaults__
        w.__dict__.update(wrapper.__dict__)
        w.__wrapped__ = new
        w.__qualname__, w.__doc__, w.__module__ = wrapper.__qualname__, wrapper.__doc__, wrapper.__module__
        new = w
    return new


def _head_dim(module: nn.Module) -> int | None:
    for name in ("head_dim", "head_size"):
        v = getattr(module, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


# ------------------------------------------------------------------------------------------ causal-LM loss


def _capture_forward(self, x: Tensor) -> Tensor:
    if self._culmen_capture:
        self._culmen_hidden = x
        return x.new_empty(*x.shape[:-1], 0)  # the model's logit post-processing runs on nothing
    return F.linear(x, self.weight, self.bias)


def _lm_forward(self, *args, **kwargs):
    labels = kwargs.pop("labels", None)
    pos = self._culmen_labels_pos
    if labels is None and pos is not None and len(args) > pos:
        labels, args = args[pos], args[:pos] + (None,) + args[pos + 1:]
    if labels is None or not self.training:
        return super(type(self), self).forward(*args, labels=labels, **kwargs)
    shift_labels = kwargs.pop("shift_labels", None)
    head = self._culmen_head
    head._culmen_capture = True
    try:
        out = super(type(self), self).forward(*args, **kwargs)
        hidden = head._culmen_hidden
    finally:
        head._culmen_capture = False
        head._culmen_hidden = None
    if shift_labels is None:
        # transformers' convention: position t predicts label t + 1; the last position predicts nothing.
        shift_labels = F.pad(labels[..., 1:], (0, 1), value=-100)
    n_items = kwargs.get("num_items_in_batch")
    loss = fused_linear_cross_entropy(hidden, head.weight, shift_labels.to(hidden.device), head.bias,
                                      ignore_index=-100, softcap=self._culmen_softcap,
                                      reduction="mean" if n_items is None else "sum")
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if isinstance(n_items, Tensor) else n_items)
    if isinstance(out, tuple):
        return (loss,) + tuple(out[1:])
    fields_ = {k: v for k, v in out.items() if k not in ("logits", "loss")}
    return type(out)(loss=loss, logits=None, **fields_)


def _patch_loss(model: nn.Module, report: PatchReport) -> None:
    if _kind_of(model) == "cross_entropy":
        report.already_patched["cross_entropy"] += 1
        return
    if "forward" in model.__dict__:
        report.notes.append(f"cross_entropy: {type(model).__name__} has an instance-level forward; loss unchanged")
        return
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        params = {}
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "labels" not in params:
        if head is not None or "labels" in params:
            report.notes.append(f"cross_entropy: {type(model).__name__} has no plain linear LM head with a labels "
                                f"argument; its loss is unchanged")
        return
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in ("logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(text, attr, None) not in (None, 1, 1.0):
            report.notes.append(f"cross_entropy: {type(model).__name__} rescales its logits ({attr}); loss unchanged")
            return
    names = list(params)
    pos = names.index("labels") - 1  # minus self
    softcap = getattr(text, "final_logit_softcapping", None)
    head.__dict__.update(_culmen_capture=False, _culmen_hidden=None)
    _swap(head, "lm_head", {"forward": _capture_forward})
    model.__dict__.update(_culmen_head=head, _culmen_labels_pos=pos, _culmen_softcap=softcap or None)
    # generate() reads the forward's signature (position_ids, logits_to_keep ...): keep the model's.
    forward = functools.update_wrapper(types.FunctionType(_lm_forward.__code__, _lm_forward.__globals__,
                                                          "forward", None, _lm_forward.__closure__),
                                       type(model).forward)
    _swap(model, "cross_entropy", {"forward": forward})
    report.counts["cross_entropy"] += 1


# ------------------------------------------------------------------------------------------------ patch

_PRIMITIVES = (nn.Linear, nn.Embedding, nn.Dropout, nn.Identity, nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _is_primitive(module: nn.Module) -> bool:
    if isinstance(module, _PRIMITIVES) or _kind_of(module) or isinstance(module, CulmenActivation):
        return True
    name = type(module).__name__
    # transformers' Conv1D (GPT-2's linear with a transposed weight) and rotary-table modules (cos/sin only).
    return name == "Conv1D" or any(b.endswith("inv_freq") for b in module._buffers)


def patch(model: nn.Module, *, rms_norm: bool = True, layer_norm: bool = True, rotary: bool = True,
          mlp: bool = True, cross_entropy: bool = True, attention: bool = True) -> PatchReport:
    """Swap culmen's fused kernels into a ``transformers`` model in place (see the module docstring for what
    is recognised and how).

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (a causal LM for ``cross_entropy``), on any device and
            dtype; its parameters stay the same objects (optimizers and ``state_dict`` are unaffected).
        rms_norm, layer_norm, rotary, mlp, cross_entropy, attention: which kinds to patch; ``mlp`` covers
            the gated MLPs and the plain activations.

    Returns a :class:`PatchReport`. Raises ``TypeError`` for a ``model`` that is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    report = PatchReport()
    cfg = getattr(model, "config", None)
    attn_done = "attention" if getattr(cfg, "_attn_implementation", None) == "culmen" else None
    covered: set[int] = set()
    unknown: Counter[str] = Counter()
    for name, module in list(model.named_modules()):
        if id(module) in covered:
            continue
        kind = _kind_of(module)
        if "forward" in module.__dict__:
            # An instance-level forward (accelerate's offload hooks, a user's wrapper) would shadow a class swap.
            report.notes.append(f"{name or type(module).__name__}: has an instance-level forward; left alone")
            continue
        if kind in ("rms_norm", "layer_norm", "mlp"):
            report.already_patched[kind] += 1
            covered.update(id(m) for m in module.modules())
            continue
        if isinstance(module, CulmenActivation):
            report.already_patched["activation"] += 1
            continue
        if kind == "rotary":
            report.already_patched["rotary"] += 1
        if attention and hasattr(module, "is_causal") and hasattr(module, "config") and getattr(
                sys.modules.get(type(module).__module__), "ALL_ATTENTION_FUNCTIONS", None) is not None:
            (report.already_patched if attn_done else report.counts)["attention"] += 1
            covered.add(id(module))
        if rotary and kind is None and _patch_rotary(module, report):
            covered.add(id(module))
            continue
        if type(module) is nn.LayerNorm or (isinstance(module, nn.LayerNorm)
                                            and type(module).forward is nn.LayerNorm.forward):
            if len(module.normalized_shape) != 1:
                unknown[type(module).__name__] += 1
            elif layer_norm:
                _swap(module, "layer_norm", {"forward": _ln_forward})
                report.counts["layer_norm"] += 1
            continue
        eps = _rms_candidate(module) if kind is None else None
        if eps is not None:
            if not rms_norm:
                continue
            probe = _probe_rms(module, eps)
            if probe is None:
                report.notes.append(f"{name}: {type(module).__name__} looks like an RMSNorm but its forward "
                                    f"does not match; left alone")
                unknown[type(module).__name__] += 1
                continue
            module.__dict__.update(_culmen_eps=eps, _culmen_zc=probe[0], _culmen_keep_dtype=probe[1])
            _swap(module, "rms_norm", {"forward": _rms_forward})
            report.counts["rms_norm"] += 1
            continue
        parts = _mlp_parts(module) if kind is None else None
        if parts is not None and mlp:
            layout, act_mod = parts
            act = _probe_act(act_mod)
            if act in ("silu", "gelu", "gelu_tanh", "relu", "sigmoid") and _probe_mlp(module, layout, act_mod):
                module.__dict__["_culmen_act"] = act
                _swap(module, "mlp", {"forward": _gated_forward if layout == "gated" else _gate_up_forward})
                report.counts["mlp"] += 1
                covered.update(id(m) for m in module.modules())
                continue
            report.notes.append(f"{name}: {type(module).__name__} has a gated-MLP layout but its activation or "
                                f"forward was not recognised; left alone")
        if type(module).__module__ in _ACT_MODULES and not module._modules and not module._parameters:
            if not mlp:
                continue
            act = _probe_act(module)
            if act is not None and name:
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, CulmenActivation(act, module))
                report.counts["activation"] += 1
            else:
                unknown[type(module).__name__] += 1
            continue
        if module._modules or _is_primitive(module) or id(module) in covered:
            continue
        if module._parameters or module._buffers:
            unknown[type(module).__name__] += 1
    if cross_entropy:
        _patch_loss(model, report)
    if attention:
        _set_attention(model)
    report.unrecognized = dict(unknown)
    return report


def _patch_rotary(module: nn.Module, report: PatchReport) -> bool:
    """Give an attention module that calls its module's ``apply_rotary_pos_emb`` a forward calling culmen's."""
    forward = type(module).forward
    inner = _unwrap_chain(forward)[-1]
    code = getattr(inner, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return False
    fn = getattr(inner, "__globals__", {}).get("apply_rotary_pos_emb")
    head_dim = _head_dim(module)
    drop_in = _probe_rotary(fn, head_dim) if callable(fn) and head_dim else None
    new_forward = _forward_with(forward, "apply_rotary_pos_emb", drop_in) if drop_in is not None else None
    if new_forward is None:
        report.notes.append(f"rotary: {type(module).__name__}'s apply_rotary_pos_emb was not recognised; left alone")
        return False
    _swap(module, "rotary", {"forward": new_forward})
    report.counts["rotary"] += 1
    return True


def _set_attention(model: nn.Module) -> None:
    from culmen.integrations.hf_attention import register

    name = register()
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = name
