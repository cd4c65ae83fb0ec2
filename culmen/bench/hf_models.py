"""``culmen bench model_train`` / ``model_decode``: whole models as users train and run them.

``model_train`` trains one architecture (GPT-2 small, or a LLaMA-3.2-1B-shaped decoder) four ways, in
one process, from the same weights on the same token batch:

* ``hf_sdpa``: ``transformers`` ``AutoModelForCausalLM`` with ``attn_implementation="sdpa"``, loss from
  ``model(input_ids, labels=labels).loss`` (the peer every Hugging Face user starts from);
* ``hf_liger``: the same model patched by Liger-Kernel (``apply_liger_kernel_to_llama``; LLaMA only),
  when ``liger_kernel`` imports;
* ``hf_culmen``: the same model patched by ``culmen.integrations.huggingface.patch`` with
  ``attn_implementation="culmen"``;
* ``fa_gpt``: ``culmen.flash_attn.models.gpt.GPTLMHeadModel`` (flash_attn's model API) built from the
  converted config and remapped weights, loss by culmen's fused linear cross-entropy on the final hidden
  states (``model.transformer(ids)`` then ``lm_head``: no logits tensor).

Every row uses ``torch.optim.AdamW(fused=True)`` (moments in the param dtype), so the rows differ only
by the model code. Params are in the benchmark dtype (bf16 on CUDA); the residual stream too (as in the
Hugging Face models). Every number is
measured by ``culmen.bench.train_step.measure_training`` (wall ms/step of back-to-back steps, host ms per
step by phase, peak GiB above the batch, loss), so the two suites read the same way. ``speedup`` is
``hf_sdpa`` ms / impl ms; ``vs_liger`` is ``hf_liger`` ms / impl ms.

``model_decode`` times greedy decoding at batch 1 (prompt 128, 256 new tokens by default) of the LLaMA
shape: ``fa_gpt`` with ``generate(..., cg=True)`` (CUDA-graph decoding) and ``cg=False``, against
``transformers`` ``generate`` with its static cache and ``torch.compile`` (``hf_static_compile``) and
plain ``generate`` (``hf_dynamic``). It reports ms per new token and the memory-bandwidth floor: the
bytes one decoding step must read (weights + the KV cache at the mean decoded length) over the measured
device copy bandwidth.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import torch

from culmen.bench.registry import BenchConfig, SuiteResult, register_suite
from culmen.bench.runner import short_error
from culmen.bench.train_step import ModelRun, TrainOptions, TrainOptionsError, _release, _sync, measure_training

TRAIN_IMPLS = ("hf_sdpa", "hf_culmen", "fa_gpt", "hf_liger")
DECODE_IMPLS = ("hf_dynamic", "fa_gpt_cg", "fa_gpt", "hf_static_compile")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Arch:
    """A model shape: ``family`` is ``gpt2`` or ``llama``."""

    name: str
    family: str
    d: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


ARCHS = {
    "gpt2": Arch("gpt2", "gpt2", 768, 12, 12, 12, 3072, 50257, 1024, 8),
    # LLaMA-3.2-1B's shape (tied embeddings, GQA 32/8).
    "llama1b": Arch("llama1b", "llama", 2048, 16, 32, 8, 8192, 128256, 2048, 4),
    "tiny-gpt2": Arch("tiny-gpt2", "gpt2", 64, 2, 4, 4, 256, 256, 32, 2),
    "tiny-llama": Arch("tiny-llama", "llama", 64, 2, 4, 2, 128, 256, 32, 2),
}


def hf_config(arch: Arch) -> Any:
    """The ``transformers`` config of ``arch`` (dropout off, so every implementation computes the same)."""
    import transformers

    if arch.family == "gpt2":
        return transformers.GPT2Config(n_embd=arch.d, n_layer=arch.layers, n_head=arch.heads, n_inner=arch.ffn,
                                       vocab_size=arch.vocab, n_positions=max(arch.seq, 1024), resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=arch.vocab - 1,
                                       eos_token_id=arch.vocab - 1)
    return transformers.LlamaConfig(hidden_size=arch.d, num_hidden_layers=arch.layers,
                                    num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
                                    intermediate_size=arch.ffn, vocab_size=arch.vocab,
                                    max_position_embeddings=max(arch.seq, 4096), tie_word_embeddings=True,
                                    rms_norm_eps=1e-5, rope_theta=500000.0, attention_dropout=0.0)


def reference_weights(arch: Arch, seed: int) -> dict[str, torch.Tensor]:
    """fp32 CPU weights of the Hugging Face model of ``arch``, initialised once per case from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch), attn_implementation="sdpa")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_hf(arch: Arch, impl: str, weights: dict[str, torch.Tensor], device: torch.device,
             dtype: torch.dtype) -> torch.nn.Module:
    """``transformers`` model of ``arch`` with ``weights``; ``hf_liger`` / ``hf_culmen`` patched in place."""
    import transformers

    attn = "sdpa"
    if impl == "hf_culmen":
        from culmen.integrations import huggingface

        huggingface.register()
        attn = "culmen"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(arch), attn_implementation="sdpa")
    model = model.to_empty(device=device)
    model.load_state_dict(weights, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    model.to(dtype)
    if impl == "hf_liger":
        if arch.family != "llama":
            raise RuntimeError("Liger-Kernel has no GPT-2 patch")
        _apply_liger_to_instance(model)
    elif impl == "hf_culmen":
        from culmen.integrations.huggingface import patch

        patch(model)
        model.config._attn_implementation = attn
    return model.train()


def _apply_liger_to_instance(model: torch.nn.Module) -> None:
    """``apply_liger_kernel_to_llama(model=model)``, kept to this one model: Liger also rebinds names in
    ``transformers``' LLaMA module and the class's ``forward`` (its fused loss), which would leak into
    every LLaMA built later in the process (the other rows, the decode suite)."""
    import types

    import transformers.models.llama.modeling_llama as mod
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    saved = dict(vars(mod))
    cls = type(model)
    saved_forward = cls.__dict__.get("forward")
    apply_liger_kernel_to_llama(model=model)
    patched_forward = cls.__dict__.get("forward")
    if patched_forward is not saved_forward:
        model.forward = types.MethodType(patched_forward, model)
        cls.forward = saved_forward
    for name, value in saved.items():
        if vars(mod).get(name) is not value:
            setattr(mod, name, value)


def build_fa_gpt(arch: Arch, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> torch.nn.Module:
    """``culmen.flash_attn.models.gpt.GPTLMHeadModel`` of ``arch``, from the Hugging Face weights through
    flash_attn's config converter and state-dict remap."""
    from culmen.flash_attn.models.gpt import GPTLMHeadModel

    cfg = hf_config(arch)
    if arch.family == "gpt2":
        from culmen.flash_attn.models.gpt import remap_state_dict_hf_gpt2

        cfg.fused_bias_fc = True
        cfg.fused_dropout_add_ln = True
        cfg.pad_vocab_size_multiple = 8
        sd = remap_state_dict_hf_gpt2(weights, cfg)
    else:
        from culmen.flash_attn.models.llama import llama_config_to_gpt2_config, remap_state_dict_hf_llama

        cfg = llama_config_to_gpt2_config(cfg)
        cfg.fused_bias_fc = True
        cfg.fused_dropout_add_ln = True
        sd = remap_state_dict_hf_llama(weights, cfg)
    cfg.use_flash_attn = True
    cfg.residual_in_fp32 = False
    model = GPTLMHeadModel(cfg, device=device, dtype=dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if "lm_head" not in k] + list(unexpected)
    if bad:
        raise RuntimeError(f"fa_gpt weights do not match: {bad[:5]}")
    if getattr(cfg, "tie_word_embeddings", True):
        model.tie_weights()
    return model.train()


def _fa_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from culmen.ops.cross_entropy import fused_linear_cross_entropy

    hidden = model.transformer(tokens)
    return fused_linear_cross_entropy(hidden, model.lm_head.weight, labels, getattr(model.lm_head, "bias", None))


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in ("model.layers", "transformer.h", "transformer.layers", "gpt_neox.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return list(obj)
    return []


def run_train_impl(arch: Arch, impl: str, weights: dict[str, torch.Tensor], opts: TrainOptions,
                   device: torch.device, tokens: torch.Tensor, labels: torch.Tensor) -> ModelRun:
    """Build, train and measure one implementation; failures land in ``error``."""
    res = ModelRun(impl)
    _release(device)
    dtype = _DTYPES[opts.dtype]
    try:
        res.base_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if impl == "fa_gpt":
            model = build_fa_gpt(arch, weights, device, dtype)
            # fa_gpt's labels are pre-shifted (HF shifts inside its loss).
            shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)

            def forward() -> torch.Tensor:
                return _fa_loss(model, tokens, shifted)
        else:
            model = build_hf(arch, impl, weights, device, dtype)

            def forward() -> torch.Tensor:
                return model(input_ids=tokens, labels=labels, use_cache=False).loss
        opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0, fused=device.type == "cuda")
        res.params = sum(p.numel() for p in model.parameters())
        measure_training(res, forward, opt, model, _layers(model), device, opts, arch.tokens)
    except Exception as exc:
        res.error = short_error(exc, 200)
    finally:
        _release(device)
    return res


def _options(cfg: BenchConfig) -> tuple[TrainOptions, tuple[str, ...], dict[str, Any]]:
    small = cfg.quick or cfg.device.type != "cuda"
    o = cfg.options
    opts = TrainOptions(steps=o.get("steps") or (2 if small else 10), warmup=o.get("warmup") or (2 if small else 3),
                        host_steps=o.get("host_steps") if o.get("host_steps") is not None else (1 if small else 3),
                        dtype=o.get("dtype") or ("fp32" if cfg.device.type != "cuda" else "bf16"),
                        time_limit=o.get("time_limit"))
    names = o.get("model_cases") or (("tiny-gpt2", "tiny-llama") if small else ("gpt2", "llama1b"))
    names = tuple(names.split(",")) if isinstance(names, str) else tuple(names)
    bad = [n for n in names if n not in ARCHS]
    if bad:
        raise TrainOptionsError(f"model_cases must be among {tuple(ARCHS)}, got {bad}")
    return opts, names, o


def _batch(arch: Arch, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, arch.vocab, (arch.batch, arch.seq), generator=g)
    return tokens.to(device), tokens.clone().to(device)


_TRAIN_COLS = (f"{'case':<10} {'impl':<10} {'params':>7} {'ms':>9} {'speedup':>8} {'vs liger':>8} {'tok/s':>9} "
               f"{'GiB':>7} {'loss':>9} {'host ms':>8} {'1st s':>6}")


def _fmt(v: float | None, spec: str, width: int) -> str:
    return "-".rjust(width) if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec).rjust(width)


@register_suite("model_train", "end_to_end")
def bench_model_train(cfg: BenchConfig, out: TextIO) -> Iterator[SuiteResult]:
    """GPT-2 small / LLaMA-1B training steps: transformers (sdpa, Liger, culmen patch) vs culmen's GPT model."""
    from culmen.bench.runner import Record

    opts, names, o = _options(cfg)
    chosen = o.get("model_impls") or o.get("impls")
    impls = tuple(chosen.split(",")) if isinstance(chosen, str) else TRAIN_IMPLS
    bad = [i for i in impls if i not in TRAIN_IMPLS]
    if bad:
        raise TrainOptionsError(f"model_impls must be among {TRAIN_IMPLS}, got {bad}")
    print(f"steps={opts.steps} after warmup={opts.warmup} + host_steps={opts.host_steps}; dtype {opts.dtype}; "
          "speedup = hf_sdpa ms / ms; vs liger = hf_liger ms / ms", file=out)
    print(_TRAIN_COLS, file=out)
    start = time.perf_counter()
    for name in names:
        arch = ARCHS[name]
        if opts.time_limit is not None and time.perf_counter() - start > opts.time_limit:
            print(f"{name:<10} skipped: time limit", file=out)
            continue
        weights = reference_weights(arch, opts.seed)
        tokens, labels = _batch(arch, cfg.device, opts.seed)
        runs = {impl: run_train_impl(arch, impl, weights, opts, cfg.device, tokens, labels) for impl in impls}
        del weights
        base = runs.get("hf_sdpa")
        liger = runs.get("hf_liger")
        records = []
        for impl, r in runs.items():
            speed = base.ms / r.ms if base and base.ms and r.ms else None
            vs_liger = liger.ms / r.ms if liger and liger.ms and r.ms else None
            print(f"{name:<10} {impl:<10} {_params_str(r.params):>7} {_fmt(r.ms, '.2f', 9)} "
                  f"{_fmt(speed, '.2f', 7)}x {_fmt(vs_liger, '.2f', 7)}x {_fmt(r.tokens_per_s, '.0f', 9)} "
                  f"{_fmt(r.peak_gib, '.2f', 7)} {_fmt(r.loss, '.4f', 9)} {_fmt(r.host_ms, '.2f', 8)} "
                  f"{_fmt(r.first_step_s, '.1f', 6)}", file=out)
            if r.error:
                print(f"{'':<22}failed: {r.error}", file=out)
            rec = Record("model_train", "end_to_end", f"{name} {opts.dtype}", "culmen" if impl == "fa_gpt" else impl,
                         ms=r.ms, error=r.error, host_us=None if r.host_ms is None else r.host_ms * 1e3)
            if impl == "fa_gpt" and speed:
                rec.speedup, rec.best_peer = speed, "hf_sdpa"
            records.append(rec)
        out.flush()
        row = {"case": name, "arch": asdict(arch), "dtype": opts.dtype, "steps": opts.steps,
               "runs": {k: asdict(v) for k, v in runs.items()}}
        yield SuiteResult(records, row)
        del tokens, labels
        _release(cfg.device)


def _params_str(n: int | None) -> str:
    return "-" if not n else (f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k")


# ------------------------------------------------------------------------------------------ decode


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Measured device-to-device copy bandwidth (bytes read + written per second / 1e9); None on CPU."""
    if device.type != "cuda":
        return None
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * a.numel() * n / (time.perf_counter() - t) / 1e9


def _decode_hf(model: torch.nn.Module, ids: torch.Tensor, new: int, static: bool) -> torch.Tensor:
    kw: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    return model.generate(ids, **kw)


def _decoder(impl: str, arch: Arch, weights: dict[str, torch.Tensor], dev: torch.device, dtype: torch.dtype,
             ids: torch.Tensor, prompt: int, new: int) -> Callable[[], Any]:
    """A zero-argument greedy decode of ``new`` tokens after ``ids`` by ``impl``."""
    if impl.startswith("fa_gpt"):
        cg = impl == "fa_gpt_cg"
        if cg and dev.type != "cuda":
            raise RuntimeError("CUDA graphs need a GPU")
        model = build_fa_gpt(arch, weights, dev, dtype).eval()
        return lambda: model.generate(ids, max_length=prompt + new, cg=cg, top_k=1)
    static = impl == "hf_static_compile"
    if static and dev.type != "cuda":
        raise RuntimeError("compiled static-cache decoding is timed on CUDA only")
    model = build_hf(arch, "hf_sdpa", weights, dev, dtype).eval()
    # transformers' generate compiles the decoding step itself when the cache is static (its default
    # CompileConfig: torch.compile with CUDA graphs); compiling model.forward here as well wrapped one graph in
    # another, and the second decode read a CUDA-graph output the next replay had overwritten (transformers 5.x).
    if static and getattr(model.generation_config, "disable_compile", False):
        model.generation_config.disable_compile = False
    return lambda: _decode_hf(model, ids, new, static)


def _time_decode(impl: str, arch: Arch, weights: dict[str, torch.Tensor], dev: torch.device, dtype: torch.dtype,
                 ids: torch.Tensor, prompt: int, new: int, reps: int = 2) -> dict[str, Any]:
    """First-call seconds, then the mean of ``reps`` timed decodes after one warm one; failures in ``error``."""
    r: dict[str, Any] = {}
    try:
        run = _decoder(impl, arch, weights, dev, dtype, ids, prompt, new)
        with torch.inference_mode():
            t = time.perf_counter()
            first = run()
            _sync(dev)
            r["first_s"] = time.perf_counter() - t
            run()
            _sync(dev)
            t = time.perf_counter()
            for _ in range(reps):
                seq = run()
            _sync(dev)
            total = (time.perf_counter() - t) / reps * 1e3
        seq_ids = seq.sequences if hasattr(seq, "sequences") else seq
        first_ids = first.sequences if hasattr(first, "sequences") else first
        r.update(total_ms=total, ms_per_token=total / new, tokens=seq_ids[0, prompt:].tolist(),
                 deterministic=bool(torch.equal(seq_ids, first_ids)))
    except Exception as exc:
        r["error"] = short_error(exc, 200)
    return r


@register_suite("model_decode", "end_to_end")
def bench_model_decode(cfg: BenchConfig, out: TextIO) -> Iterator[SuiteResult]:
    """Greedy decoding, batch 1: culmen's GPT with CUDA graphs vs transformers generate (static cache + compile)."""
    from culmen.bench.runner import Record

    small = cfg.quick or cfg.device.type != "cuda"
    o = cfg.options
    name = "tiny-llama" if small else (o.get("decode_case") or "llama1b")
    arch = ARCHS[name]
    prompt, new = (8, 8) if small else (128, 256)
    dtype = _DTYPES[o.get("dtype") or ("fp32" if cfg.device.type != "cuda" else "bf16")]
    dev = cfg.device
    weights = reference_weights(arch, 0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, arch.vocab, (1, prompt), generator=g).to(dev)
    bw = copy_bandwidth_gbps(dev)
    elem = torch.finfo(dtype).bits // 8
    weight_bytes = sum(v.numel() for k, v in weights.items() if "lm_head" not in k or "embed" in k) * elem
    kv_bytes = 2 * arch.layers * arch.kv_heads * (arch.d // arch.heads) * elem * (prompt + new / 2)
    # A copy moves its bytes twice (read + write) at the DRAM rate bw; a decode step only reads.
    floor_ms = (weight_bytes + kv_bytes) / (bw * 1e9) * 1e3 if bw else None
    print(f"{name}: batch 1, prompt {prompt}, {new} new tokens, {str(dtype).replace('torch.', '')}; copy bandwidth "
          f"{_fmt(bw, '.0f', 0)} GB/s (read + write); floor = (weights {weight_bytes / 2**30:.2f} GiB + KV) / that = "
          f"{_fmt(floor_ms, '.3f', 0)} ms/token", file=out)
    print(f"{'impl':<18} {'ms/token':>9} {'total ms':>9} {'vs floor':>8} {'speedup':>8}", file=out)
    results: dict[str, dict[str, Any]] = {}
    for impl in DECODE_IMPLS:
        _release(dev)
        results[impl] = r = _time_decode(impl, arch, weights, dev, dtype, ids, prompt, new)
        print(f"  {impl}: {_fmt(r.get('ms_per_token'), '.3f', 0)} ms/token, first call "
              f"{_fmt(r.get('first_s'), '.1f', 0)} s{'  failed: ' + r['error'] if r.get('error') else ''}",
              file=out, flush=True)
    base = results.get("hf_static_compile", {}).get("ms_per_token") or results.get("hf_dynamic", {}).get("ms_per_token")
    records = []
    ref_tokens = results.get("hf_dynamic", {}).get("tokens")
    for impl, r in results.items():
        mpt = r.get("ms_per_token")
        speed = base / mpt if base and mpt else None
        same = None if ref_tokens is None or r.get("tokens") is None else r["tokens"] == ref_tokens
        print(f"{impl:<18} {_fmt(mpt, '.3f', 9)} {_fmt(r.get('total_ms'), '.1f', 9)} "
              f"{_fmt(mpt / floor_ms if mpt and floor_ms else None, '.2f', 7)}x {_fmt(speed, '.2f', 7)}x"
              + ("" if same is None else f"  tokens {'equal' if same else 'differ'} from hf_dynamic"), file=out)
        if r.get("error"):
            print(f"{'':<20}failed: {r['error']}", file=out)
        rec = Record("model_decode", "end_to_end", f"{name} b1 p{prompt} n{new}",
                     "culmen" if impl == "fa_gpt_cg" else impl, ms=r.get("total_ms"), error=r.get("error"))
        if impl == "fa_gpt_cg" and speed:
            rec.speedup, rec.best_peer = speed, "hf_static_compile"
        records.append(rec)
    for r in results.values():
        r.pop("tokens", None)
    yield SuiteResult(records, {"case": name, "prompt": prompt, "new_tokens": new, "copy_gbps": bw,
                                "floor_ms_per_token": floor_ms, "runs": results})


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``model_train`` / ``model_decode`` options."""
    g = p.add_argument_group("model_train / model_decode options")
    g.add_argument("--model-cases", metavar="LIST", help=f"model_train architectures from {','.join(ARCHS)} "
                                                         "(default gpt2,llama1b on CUDA)")
    g.add_argument("--model-impls", metavar="LIST", help=f"model_train implementations from {','.join(TRAIN_IMPLS)} "
                                                         "(default: all)")

