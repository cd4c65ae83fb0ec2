"""Check and time the warp-specialized Gluon attention backward against culmen's Triton backward and SDPA.

    python3 scripts/tune_attention_ws_bwd.py [--d 64,128] [--seqlen 2048,8192] [--tiles "64,2,0 64,2,1 64,3,1"]
                                             [--check-only] [--gqa 1]

Correctness first (odd shapes, GQA, causal with sq < sk, a strided q): dQ, dK, dV of ``flash_attn_func``'s
backward through the Gluon kernel against a float64 reference, beside the Triton backward's error on the same
inputs (flash_attn's rule: at most 3x it, plus a small absolute slack). Then for every (d, seqlen, causal,
tile): wall ms of the eager backward (``torch.autograd.grad`` on a kept graph, do_bench median) and its
TFLOP/s (2.5x the forward's flops), at batch*seqlen = 16k tokens, hidden 2048, bf16, with the Triton backward
and SDPA-cuDNN / SDPA-flash in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the forward's tune script (its check cases)

from culmen.ops.attention import launch_ws  # noqa: E402
from culmen.ops.common.plans import clear_plans  # noqa: E402


class _Tile:
    """Context: the Gluon backward on with ``tile`` for every head dim, or off (``None``), for the plans built
    inside it (a forward's plan, kept by autograd, decides its backward)."""

    def __init__(self, tile):
        self.tile = tile

    def __enter__(self):
        t = launch_ws.WS_BWD_TUNING
        self.saved = (t["on"], dict(t["tiles"]), t["persistent"], dict(t["min_sk"]))
        t["on"] = self.tile is not None
        if self.tile is not None:  # (BLOCK_M, STAGES, PERSISTENT)
            t["tiles"] = {64: self.tile[:2], 128: self.tile[:2]}
            t["min_sk"] = {}  # a tile row times the Gluon kernel even below the length where it ships
            t["persistent"] = bool(self.tile[2])
        clear_plans()

    def __exit__(self, *exc):
        t = launch_ws.WS_BWD_TUNING
        t["on"], t["tiles"], t["persistent"], t["min_sk"] = self.saved
        clear_plans()


def _grads(q, k, v, dout, causal, tile):
    """``(dq, dk, dv)`` of culmen's flash_attn_func with the Gluon backward at ``tile`` (``None``: Triton)."""
    from culmen.flash_attn import flash_attn_func

    with _Tile(tile):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qq, kk, vv, causal=causal)
        return torch.autograd.grad(out, (qq, kk, vv), dout)


def _ref_grads(q, k, v, dout, causal, scale):
    from culmen.ops.attention.reference import attention_bwd_ref, attention_fwd_ref

    q64, k64, v64, d64 = (t.double() for t in (q, k, v, dout))
    o, lse, _ = attention_fwd_ref(q64, k64, v64, softmax_scale=scale, causal=causal)
    return attention_bwd_ref(d64, q64, k64, v64, o, lse, softmax_scale=scale, causal=causal)


def check(tiles, d_list):
    from tune_attention_ws import CHECK_CASES, check_inputs

    bad = 0
    for d in d_list:
        for tile in tiles:
            for (B, sq, sk, H, hk, causal) in CHECK_CASES:
                q, k, v = check_inputs(B, sq, sk, H, hk, d)
                dout = torch.randn(B, sq, H, d, device="cuda", dtype=torch.bfloat16)
                if launch_ws.ws_config(q, k, v, causal=causal, extras=False, on_gpu=True, hopper=True) is None:
                    print(f"d{d} {tile} B{B} sq{sq} sk{sk} h{H}/{hk} causal={causal}: not eligible")
                    continue
                ws = _grads(q, k, v, dout, causal, tile)
                tr = _grads(q, k, v, dout, causal, None)
                ref = _ref_grads(q, k, v, dout, causal, d ** -0.5)
                errs = []
                ok = True
                for name, a, t, r in zip("qkv", ws, tr, ref):
                    e_ws = (a.double() - r).abs().max().item()
                    e_tr = (t.double() - r).abs().max().item()
                    ok = ok and e_ws <= 3 * e_tr + 1e-3 and bool(torch.isfinite(a).all())
                    errs.append(f"d{name} {e_ws:.2e} ({e_tr:.2e})")
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} d{d} tile{tile} B{B} sq{sq} sk{sk} h{H}/{hk} causal={causal}: "
                      + ", ".join(errs), flush=True)
    return bad


def _sdpa(q, k, v, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa > 1)


def bench(tiles, d_list, seqlens, gqa, fwd=False):
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tune_attention_ws import bench_inputs

    from culmen.flash_attn import flash_attn_func

    print(f"{'case':<28}{'impl':<18}{'ms':>8}{'TFLOP/s':>9}")
    for d in d_list:
        for s in seqlens:
            for causal in (False, True):
                B, H, q, k, v, g = bench_inputs(d, s, gqa)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                dout = torch.randn(B, s, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
                fl = 2.5 * 4 * B * H * s * s * d / (2 if causal else 1)
                case = f"d{d} s{s} {'causal' if causal else 'full'} g{gqa}"
                rows = []
                for tile in [None, *tiles]:
                    with _Tile(tile):
                        out = flash_attn_func(q, k, v, causal=causal)
                    rows.append((f"ws {tile}" if tile else "culmen triton", out, dout, tile))
                qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        with sdpa_kernel([be]):
                            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                                 enable_gqa=gqa > 1)
                        rows.append((f"sdpa {name}", o, dout.transpose(1, 2), "sdpa"))
                    except Exception as e:
                        print(f"{case:<28}sdpa {name:<13}  failed: {type(e).__name__}: {str(e)[:100]}")
                if fwd:  # the forward too (Gluon forward vs SDPA-cuDNN), wall ms of the eager call
                    qd, kd, vd = (t.detach() for t in (q, k, v))
                    ff = fl / 2.5
                    for name, fn in (("fwd culmen", partial(flash_attn_func, qd, kd, vd, causal=causal)),
                                     ("fwd cudnn", partial(_sdpa, qt.detach(), kt.detach(), vt.detach(), causal,
                                                           gqa))):
                        ms = triton.testing.do_bench(fn, warmup=30, rep=200)
                        print(f"{case:<28}{name:<18}{ms:8.3f}{ff / ms / 1e9:9.1f}", flush=True)
                for name, out, do, tile in rows:
                    ins = (qt, kt, vt) if tile == "sdpa" else (q, k, v)

                    def fn(out=out, do=do, ins=ins):
                        return torch.autograd.grad(out, ins, do, retain_graph=True)
                    try:
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=30, rep=200)
                        print(f"{case:<28}{name:<18}{ms:8.3f}{fl / ms / 1e9:9.1f}", flush=True)
                    except Exception as e:
                        print(f"{case:<28}{name:<18}  failed: {type(e).__name__}: {str(e)[:160]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--seqlen", default="2048,8192")
    ap.add_argument("--tiles", default="64,2,1 64,2,0",
                    help="BLOCK_M,STAGES,PERSISTENT ...")
    ap.add_argument("--check-d", default=None, help="head dims of the check (default: --d)")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--fwd", action="store_true", help="also time the forward (Gluon vs SDPA-cuDNN)")
    ap.add_argument("--l2", type=int, default=None, help="l2_bytes of the causal tile order (fwd and bwd)")
    a = ap.parse_args()
    if a.l2 is not None:
        launch_ws.WS_TUNING["l2_bytes"] = launch_ws.WS_BWD_TUNING["l2_bytes"] = a.l2
    tiles = [tuple(int(x) for x in t.split(",")) for t in a.tiles.split()]
    d_list = [int(x) for x in a.d.split(",")]
    check_d = ([int(x) for x in a.check_d.split(",") if x] if a.check_d is not None else d_list)
    bad = check(tiles, check_d) if check_d else 0
    print(f"check: {bad} bad", flush=True)
    if not a.check_only:
        bench(tiles, d_list, [int(x) for x in a.seqlen.split(",")], a.gqa, a.fwd)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
