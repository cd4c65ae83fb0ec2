"""Bisect culmen's torch.compile failures on the GPU: each piece (one op of the training benchmark at its
shapes, an op family's compiled test case, or a 1- or 8-layer model) compiled (Inductor, fullgraph) fwd+bwd in
its own process (CUDA_LAUNCH_BLOCKING=1), compared with eager; Inductor's mutation-analysis warnings are
counted. ``python scripts/compile_debug.py [piece ...]`` (no argument: every piece)."""

import os
import subprocess
import sys

import torch

PIECES = (
    "rms_prenorm", "rotary_qkv", "attention", "swiglu", "flce", "act_bias", "act_glu", "act_fm",
    "act_am", "attn_packed", "rotary_attn", "llama_1", "llama_1_fwd", "gpt2_1", "llama_2", "llama_8",
    "llama_8_fwd", "llama_8_train", "llama_1_train",
)


def _inputs(piece: str):
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    B, S, D, H = 8, 512, 512, 8
    if piece == "rms_prenorm":
        from culmen.flash_attn.ops.triton.layer_norm import rms_norm_fn

        x, r = (torch.randn(B, S, D, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        w = torch.randn(D, device=dev, dtype=bf, requires_grad=True)
        return (lambda x, r: sum(t.float().sum() for t in rms_norm_fn(x, w, None, residual=r, prenorm=True))), \
            (x, r), [w]
    if piece == "rotary_qkv":
        from culmen.flash_attn.layers.rotary import apply_rotary_emb_qkv_

        lin = torch.randn(B, S, 3 * D, device=dev, dtype=bf, requires_grad=True)
        cos, sin = (torch.randn(S, D // H // 2, device=dev, dtype=bf) for _ in range(2))
        return (lambda t: apply_rotary_emb_qkv_((t * 1).view(B, S, 3, H, D // H), cos, sin)), (lin,), []
    if piece == "attention":
        from culmen.flash_attn import flash_attn_func

        q, k, v = (torch.randn(B, S, H, D // H, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
        return (lambda q, k, v: flash_attn_func(q, k, v, causal=True)), (q, k, v), []
    if piece == "swiglu":
        from culmen.flash_attn.ops.activations import swiglu

        a, b = (torch.randn(B * S, 1376, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        return (lambda a, b: swiglu(a * 1, b * 1)), (a, b), []
    if piece == "flce":
        from culmen.ops.cross_entropy import fused_linear_cross_entropy

        h = torch.randn(B * S, D, device=dev, dtype=bf, requires_grad=True)
        w = (torch.randn(32000, D, device=dev, dtype=bf) * 0.02).requires_grad_()
        lab = torch.randint(0, 32000, (B * S,), device=dev)
        return (lambda h: fused_linear_cross_entropy(h, w, lab)), (h,), [w]
    if piece.startswith("act_"):
        from culmen.flash_attn.ops.fused_dense import FusedMLP
        from culmen.mlp import MLP
        from culmen.ops.activations import bias_act, gated_act

        x = torch.randn(64, 256, device=dev, dtype=bf, requires_grad=True)
        w2 = torch.randn(64, 512, device=dev, dtype=bf, requires_grad=True)
        b = torch.randn(512, device=dev, dtype=bf, requires_grad=True)
        if piece == "act_bias":
            return (lambda x, w2: bias_act(w2, b, "gelu")), (x, w2), [b]
        if piece == "act_glu":
            return (lambda x, w2: gated_act(*w2.chunk(2, -1), "silu")), (x, w2), []
        mod = (FusedMLP(256, 1024, activation="gelu_approx", dtype=bf, device=dev) if piece == "act_fm"
               else MLP([256, 512, 256], activation="relu").to(dev, bf))
        return (lambda x, w2: mod(x)), (x, w2), list(mod.parameters())
    if piece in ("attn_packed", "rotary_attn"):
        from culmen.flash_attn import flash_attn_func
        from culmen.flash_attn.layers.rotary import apply_rotary_emb_qkv_

        h = torch.randn(B, S, D, device=dev, dtype=bf, requires_grad=True)
        w = (torch.randn(3 * D, D, device=dev, dtype=bf) * D ** -0.5).requires_grad_()
        cos, sin = (torch.randn(S, D // H // 2, device=dev, dtype=bf) for _ in range(2))

        def fn(h, w):
            qkv = torch.nn.functional.linear(h, w).view(B, S, 3, H, D // H)
            if piece == "rotary_attn":
                qkv = apply_rotary_emb_qkv_(qkv, cos, sin)
            q, k, v = qkv.unbind(2)
            return flash_attn_func(q, k, v, causal=True)

        return fn, (h, w), []
    from culmen.bench.models import build_model, make_batch, model_config, with_overrides

    style = "gpt2" if piece.startswith("gpt2") else "llama"
    cfg = with_overrides(model_config(style, "d512"), layers=int(piece.split("_")[1]))
    model = build_model(cfg, "culmen", torch.device(dev), bf)
    tokens, labels = make_batch(cfg, torch.device(dev))
    return (lambda t, y: model(t, y)), (tokens, labels), list(model.parameters())


def train(piece: str) -> None:
    """A few steps of train_step's loop (compiled model, culmen's FusedAdam), synchronizing after each."""
    from culmen.bench.models import (
        build_model,
        build_optimizer,
        compile_model,
        make_batch,
        model_config,
        with_overrides,
    )

    cfg = with_overrides(model_config("llama", "d512"), layers=int(piece.split("_")[1]))
    dev = torch.device("cuda")
    model = build_model(cfg, "culmen", dev, torch.bfloat16)
    opt = build_optimizer(model, "culmen")
    fn = compile_model(model, "model")
    tokens, labels = make_batch(cfg, dev)
    for i in range(4):
        loss = fn(tokens, labels)
        torch.cuda.synchronize()
        print(piece, "step", i, "forward ok", float(loss), flush=True)
        loss.backward()
        torch.cuda.synchronize()
        print(piece, "step", i, "backward ok", flush=True)
        opt.step()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        print(piece, "step", i, "optimizer ok", flush=True)


def run(piece: str) -> None:
    if piece.endswith("_train"):
        return train(piece)
    fn, args, params = _inputs(piece)
    diff = [a for a in args if a.is_floating_point() and a.requires_grad] + params
    c = torch.compile(fn, fullgraph=True)
    res = []
    for f in (fn, c):
        out = f(*args)
        if piece.endswith("_fwd"):
            res.append([out.float()])
            continue
        loss = out.float().square().mean() if out.dim() else out
        g = torch.autograd.grad(loss, diff, allow_unused=True)
        torch.cuda.synchronize()
        res.append([out.float(), *[t.float() for t in g if t is not None]])
    errs = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(res[1], res[0])]
    print(piece, "max rel err per output:", " ".join(f"{e:.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        run(sys.argv[2])
        sys.exit(0)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for p in sys.argv[1:] or PIECES:
        r = subprocess.run([sys.executable, __file__, "--one", p], env=env, capture_output=True, text=True,
                           timeout=300)
        text = r.stdout + r.stderr
        lines = text.splitlines()
        n_warn = text.count("Encountered an exception in identify_")
        keep = [ln for ln in lines if ln.startswith(p) or "Error" in ln or "error:" in ln][:8]
        print(f"== {p}: rc={r.returncode} mutation-analysis failures={n_warn}", *keep, sep="\n", flush=True)
        if r.returncode:
            tail = [ln for ln in lines if not ln.startswith(("W1", "frame #"))][-25:]
            print(*tail, sep="\n", flush=True)
