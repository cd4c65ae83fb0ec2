"""Optimizer-step benchmarks: ``fused_adam``, ``fused_sgd``, ``fused_lamb``, ``fused_novograd``, ``fused_lars``.

Param sets (all gradients random, never zeros):

* ``100x1M``: 100 fp32 tensors of 2^20 elements;
* ``gpt2-medium``: the 24-layer GPT-2 medium parameter set (355M params in 293 tensors: 50257x1024
  token and 1024x1024 position embeddings, per layer qkv 1024x3072, proj 1024x1024, fc 1024x4096, fc2
  4096x1024 weights and their biases, two LayerNorms, plus the final LayerNorm);
* ``gpt2-medium bf16+master``: the same in bf16 with fp32 master weights.

Each provider of a case owns an identical copy of the params, gradients and optimizer state, so the
sanity pass compares the providers' params after the same steps. Peers: ``fused`` / ``foreach``
(``torch.optim.AdamW`` / ``SGD`` with ``fused=True`` / ``foreach=True``); for bf16 params with masters
``fused_m`` (torch's fused AdamW on fp32 masters, plus the gradient copy into the masters and the copy
back into the bf16 params that such a setup needs) and ``fused_bf`` (torch's fused AdamW directly on the
bf16 params with bf16 moments: no masters, not the same numerics, listed for reference); for LAMB,
NovoGrad and LARS (absent from torch) ``eager``, the per-tensor reference of
``culmen.optimizers.reference``.

Bytes counted per parameter (the fewest the update must move; each input read once, each output
written once): AdamW fp32 28 (read g, p, m, v; write p, m, v), bf16 with fp32 masters 28 (read g 2,
master 4, m 4, v 4; write p 2, master 4, m 4, v 4); SGD with momentum 20 (read g, p, buf; write p,
buf); LAMB 44 (global grad norm: read g; moments: read g, p, m, v, write m, v; the trust ratio needs
the update's norm before the params move, so a second pass reads p and the update and writes p: 4 + 24
+ 16); NovoGrad 24 (per-tensor grad norms: read g; update: read g, p, m, write p, m); LARS 28
(per-tensor norms: read p, g; update: read g, p, buf, write p, buf).

Kernel launches per step are counted with ``torch.profiler`` (the CUDA kernels and memcpy/memset of one
steady-state step, after a first step that allocates the state) and printed under each case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark

FAMILY = "optimizers"
VOCAB, D_MODEL, N_LAYER, N_POS = 50257, 1024, 24, 1024


def gpt2_medium_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 medium (355M parameters)."""
    d = D_MODEL
    shapes: list[tuple[int, ...]] = [(VOCAB, d), (N_POS, d)]
    for _ in range(N_LAYER):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def _sets(quick: bool, device: torch.device) -> list[tuple[str, list[tuple[int, ...]]]]:
    if quick:
        return [("8x4097", [(4097,)] * 8), ("mixed-small", [(33, 65), (1000,), (7,), (257, 3)])]
    return [("100x1M", [(1 << 20,)] * 100), ("gpt2-medium", gpt2_medium_shapes())]


def _numel(shapes: list[tuple[int, ...]]) -> int:
    n = 0
    for s in shapes:
        k = 1
        for d in s:
            k *= d
        n += k
    return n


class _Model:
    """One provider's params with gradients (identical across providers: same seed)."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.params: list[Tensor] = []
        for s in shapes:
            p = torch.randn(s, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
            p.grad = torch.randn(s, generator=gen, device=device, dtype=torch.float32).mul_(1e-3).to(dtype)
            self.params.append(p)
        self.saved = None

    def keep_grads(self) -> None:
        """Optimizers that overwrite the gradients (LAMB) get them back before each untimed call."""
        self.saved = [p.grad.clone() for p in self.params]

    def restore(self) -> None:
        if self.saved is not None:
            for p, g in zip(self.params, self.saved):
                p.grad.copy_(g)

    def sample(self) -> dict[str, Tensor]:
        ps = self.params
        return {"p_first": ps[0].detach().reshape(-1)[:65536].float(), "p_mid": ps[len(ps) // 2].detach().float(),
                "p_last": ps[-1].detach().float()}


class _Provider:
    """A timed step; its first two calls (launch count, sanity check) restore the gradients first."""

    def __init__(self, model: _Model, step: Callable[[], Any]):
        self.model, self.step, self.calls = model, step, 0

    def __call__(self) -> dict[str, Tensor] | None:
        self.calls += 1
        if self.calls <= 2:
            self.model.restore()
            self.step()
            return self.model.sample()
        self.step()
        return None


def count_kernels(fn: Callable[[], Any], device: torch.device) -> tuple[int, int]:
    """(CUDA kernels, memcpy/memset operations) one call of ``fn`` launches, counted with torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = copies = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if name.startswith("memcpy") or name.startswith("memset"):
            copies += 1
        else:
            kernels += 1
    return kernels, copies


def _finish(label: str, providers: dict[str, _Provider], nbytes: int, bytes_note: str, device: torch.device,
            reference: str, informational: tuple[str, ...] = ()) -> Case:
    notes = [bytes_note]
    for prov in providers.values():
        prov()  # first step: state allocation, compilation, launch tables (not what a step costs after)
    if device.type == "cuda":
        counts = []
        for name, prov in providers.items():
            try:
                prov.model.restore()  # (LAMB writes its updates over the gradients)
                k, c = count_kernels(prov.step, device)  # a steady-state step
                counts.append(f"{name}={k}" + (f" (+{c} memcpy/memset)" if c else ""))
            except Exception as exc:  # the profiler is optional: the timing still runs
                counts.append(f"{name}=? ({type(exc).__name__})")
        notes.append(f"{label}: kernel launches per step: " + ", ".join(counts))
    return Case(label, dict(providers), bytes=nbytes, reference=reference, notes=notes,
                informational=informational)


# ------------------------------------------------------------------------------------------ Adam


@register_benchmark("fused_adam", FAMILY)
def fused_adam_bench(cfg: BenchConfig) -> Iterator[Case]:
    """FusedAdam (AdamW mode) step vs torch.optim.AdamW fused / foreach; bf16 params with fp32 masters."""
    dev = cfg.device
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for name, shapes in _sets(cfg.quick, dev):
        yield _fp32_adam_case(name, shapes, dev, kw)
        if name.startswith("gpt2") or cfg.quick:
            yield _bf16_master_case(name, shapes, dev, kw)


def _fp32_adam_case(name: str, shapes: list[tuple[int, ...]], dev: torch.device, kw: dict) -> Case:
    from culmen.optimizers import FusedAdam

    providers: dict[str, _Provider] = {}
    m = _Model(shapes, torch.float32, dev)
    providers[CULMEN] = _Provider(m, FusedAdam(m.params, adam_w_mode=True, **kw).step)
    for peer in ("fused", "foreach"):
        if peer == "fused" and dev.type != "cuda":
            continue
        mp = _Model(shapes, torch.float32, dev)
        providers[peer] = _Provider(mp, torch.optim.AdamW(mp.params, **kw, **{peer: True}).step)
    return _finish(f"{name} fp32", providers, 28 * _numel(shapes), "AdamW bytes/param: fp32 28 (r g,p,m,v; "
                   "w p,m,v); bf16+master 28 (r g2,q4,m4,v4; w p2,q4,m4,v4)", dev,
                   "fused" if dev.type == "cuda" else "foreach")


def _bf16_master_case(name: str, shapes: list[tuple[int, ...]], dev: torch.device, kw: dict) -> Case:
    from culmen.optimizers import FusedAdam

    n = _numel(shapes)
    providers: dict[str, _Provider] = {}
    m = _Model(shapes, torch.bfloat16, dev)
    opt = FusedAdam(m.params, adam_w_mode=True, master_weights=True, **kw)
    providers[CULMEN] = _Provider(m, opt.step)

    mm = _Model(shapes, torch.bfloat16, dev)
    masters = [p.detach().float().requires_grad_() for p in mm.params]
    for q in masters:
        q.grad = torch.empty_like(q)
    fused = dev.type == "cuda"
    om = torch.optim.AdamW(masters, **kw, **({"fused": True} if fused else {"foreach": True}))
    bf_params, bf_grads, m_grads = list(mm.params), [p.grad for p in mm.params], [q.grad for q in masters]

    def master_step() -> None:
        torch._foreach_copy_(m_grads, bf_grads)
        om.step()
        with torch.no_grad():
            torch._foreach_copy_(bf_params, masters)

    providers["fused_m"] = _Provider(mm, master_step)
    if fused:
        mb = _Model(shapes, torch.bfloat16, dev)
        ob = torch.optim.AdamW(mb.params, fused=True, **kw)
        providers["fused_bf"] = _Provider(mb, ob.step)
    return _finish(f"{name} bf16+master", providers, 28 * n,
                   "fused_bf: torch fused AdamW on the bf16 params (bf16 moments, no masters: 14 B/param, other "
                   "numerics; informational, not counted as the best peer)", dev, "fused_m", ("fused_bf",))


# ------------------------------------------------------------------------------------------- SGD


@register_benchmark("fused_sgd", FAMILY)
def fused_sgd_bench(cfg: BenchConfig) -> Iterator[Case]:
    """FusedSGD (momentum 0.9, weight decay) step vs torch.optim.SGD fused / foreach."""
    from culmen.optimizers import FusedSGD

    dev = cfg.device
    kw = dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)
    for name, shapes in _sets(cfg.quick, dev):
        n = _numel(shapes)
        providers: dict[str, _Provider] = {}
        m = _Model(shapes, torch.float32, dev)
        opt = FusedSGD(m.params, **kw)
        providers[CULMEN] = _Provider(m, opt.step)
        for peer in ("fused", "foreach"):
            if peer == "fused" and dev.type != "cuda":
                continue
            mp = _Model(shapes, torch.float32, dev)
            o = torch.optim.SGD(mp.params, **kw, **{peer: True})
            providers[peer] = _Provider(mp, o.step)
        yield _finish(f"{name} fp32", providers, 20 * n, "SGD bytes/param: 20 (r g,p,buf; w p,buf)", dev,
                      "fused" if dev.type == "cuda" else "foreach")


# ------------------------------------------------------------------------ LAMB, NovoGrad, LARS


def _layerwise(cfg: BenchConfig, make_ours: Callable, make_ref: Callable, bytes_per_param: int, note: str,
               overwrites_grads: bool = False) -> Iterator[Case]:
    dev = cfg.device
    for name, shapes in _sets(cfg.quick, dev):
        n = _numel(shapes)
        m = _Model(shapes, torch.float32, dev)
        mr = _Model(shapes, torch.float32, dev)
        if overwrites_grads:
            m.keep_grads()
        providers = {CULMEN: _Provider(m, make_ours(m.params).step), "eager": _Provider(mr, make_ref(mr.params).step)}
        yield _finish(f"{name} fp32", providers, bytes_per_param * n, note, dev, "eager")


@register_benchmark("fused_lamb", FAMILY)
def fused_lamb_bench(cfg: BenchConfig) -> Iterator[Case]:
    """FusedLAMB step (global-norm clipping, trust ratio) vs the per-tensor eager reference."""
    from culmen.optimizers import FusedLAMB
    from culmen.optimizers.reference import RefLAMB

    kw = dict(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
    return _layerwise(cfg, lambda ps: FusedLAMB(ps, **kw), lambda ps: RefLAMB(ps, **kw), 44,
                      "LAMB bytes/param: 44 (grad norm r g; moments r g,p,m,v w m,v; apply r p,u w p)",
                      overwrites_grads=True)


@register_benchmark("fused_novograd", FAMILY)
def fused_novograd_bench(cfg: BenchConfig) -> Iterator[Case]:
    """FusedNovoGrad step vs the per-tensor eager reference."""
    from culmen.optimizers import FusedNovoGrad
    from culmen.optimizers.reference import RefNovoGrad

    kw = dict(lr=1e-3, weight_decay=0.01)
    return _layerwise(cfg, lambda ps: FusedNovoGrad(ps, **kw), lambda ps: RefNovoGrad(ps, **kw), 24,
                      "NovoGrad bytes/param: 24 (norms r g; update r g,p,m w p,m)")


@register_benchmark("fused_lars", FAMILY)
def fused_lars_bench(cfg: BenchConfig) -> Iterator[Case]:
    """FusedLARS step (momentum 0.9) vs the per-tensor eager reference."""
    from culmen.optimizers import FusedLARS
    from culmen.optimizers.reference import RefLARS

    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02)
    return _layerwise(cfg, lambda ps: FusedLARS(ps, **kw), lambda ps: RefLARS(ps, **kw), 28,
                      "LARS bytes/param: 28 (norms r p,g; update r g,p,buf w p,buf)")
