"""Check and time the warp-specialized Gluon attention forward against culmen's Triton forward and SDPA.

    python3 scripts/tune_attention_ws.py [--d 64,128] [--seqlen 2048,8192] [--tiles "128,2 128,3 64,3"]
                                         [--check-only] [--gqa 1]
    python3 scripts/tune_attention_ws.py --fp8 [--tiles ...]   # the FP8 forward: Gluon vs Triton vs bf16

Correctness first (odd shapes, GQA, causal with sq < sk, a strided q): output and lse against a float64
reference, beside the Triton forward's error on the same inputs. Then for every (d, seqlen, causal,
tile): wall ms of the eager call (do_bench median, allocations included) and TFLOP/s, at batch*seqlen =
16k tokens, hidden 2048, bf16, with the Triton forward, SDPA-cuDNN and SDPA-flash in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triton.runtime.errors import OutOfResources  # noqa: E402

from culmen.ops.attention import launch, launch_ws  # noqa: E402
from culmen.ops.attention.tma import ensure_allocator  # noqa: E402


def _ref(q, k, v, causal, scale):
    """Output and lse of culmen's reference path in float64."""
    from culmen.ops.attention.reference import attention_fwd_ref

    o, lse, _ = attention_fwd_ref(q.double(), k.double(), v.double(), softmax_scale=scale, causal=causal)
    return o, lse


def _ws(q, k, v, causal, tile, scale):
    B, sq, H, d = q.shape
    out = torch.empty(B, sq, H, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, sq, device=q.device, dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    launch_ws.ws_forward(q, k, v, out, lse, scale * launch.LOG2E_F, causal, tile, stream)
    return out, lse


# (head dim, tile) pairs whose shared memory does not fit, found by check() and left out of the timing
UNFIT: set = set()

# (B, sq, sk, heads, KV heads, causal): odd lengths, GQA, sq < sk causal, one query row, many small batches
CHECK_CASES = [(2, 1000, 1000, 4, 4, False), (2, 1000, 1000, 4, 4, True), (1, 777, 1531, 8, 2, True),
               (3, 300, 300, 2, 1, True), (1, 129, 65, 2, 2, False), (2, 2048, 2048, 8, 2, True),
               (1, 64, 4000, 4, 4, True), (2, 1, 300, 4, 1, False), (40, 512, 512, 8, 8, True)]


def check_inputs(B, sq, sk, H, hk, d):
    """bf16 ``q, k, v`` of one check case (q strided like a packed qkv projection), seeded by the shape."""
    torch.manual_seed(sq + sk + d)
    qkv = torch.randn(B, sq, H + 2 * hk, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    return qkv[:, :, :H], k, v


def check(tiles, d_list):
    from culmen.flash_attn import flash_attn_func

    ensure_allocator(torch.device("cuda"))
    bad = 0
    for d in d_list:
        for tile in tiles:
            for (B, sq, sk, H, hk, causal) in CHECK_CASES:
                q, k, v = check_inputs(B, sq, sk, H, hk, d)
                scale = d ** -0.5
                cfg = launch_ws.ws_config(q, k, v, causal=causal, extras=False, on_gpu=True, hopper=True)
                if cfg is None:
                    print(f"d{d} {tile} B{B} sq{sq} sk{sk} h{H}/{hk} causal={causal}: not eligible")
                    continue
                if (d, tile) in UNFIT:
                    continue
                try:
                    o, lse = _ws(q, k, v, causal, tile, scale)
                except OutOfResources as e:  # a tile the shared memory cannot hold at this head dim: skip it
                    print(f"d{d} tile{tile}: does not fit ({e})")
                    UNFIT.add((d, tile))
                    continue
                torch.cuda.synchronize()
                ro, rl = _ref(q, k, v, causal, scale)
                to, tl_, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
                e_ws = (o.double() - ro).abs().max().item()
                e_tr = (to.double() - ro).abs().max().item()
                e_lse = (lse.double() - rl).abs().max().item()
                ok = e_ws <= 2 * e_tr + 1e-3 and e_lse < 1e-3 and torch.isfinite(o).all().item()
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} d{d} tile{tile} B{B} sq{sq} sk{sk} h{H}/{hk} causal={causal}: "
                      f"out err {e_ws:.2e} (triton {e_tr:.2e}) lse err {e_lse:.2e}")
    return bad


def _rows(q, k, v, causal, gqa, scale, tiles):
    """(name, callable) per implementation; "ws P" rows run the persistent grid, "ws" one program per tile."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from culmen.flash_attn import flash_attn_func

    def triton_fwd():
        launch_ws.WS_TUNING["on"] = False
        try:
            return flash_attn_func(q, k, v, causal=causal)
        finally:
            launch_ws.WS_TUNING["on"] = True

    rows = [("culmen triton", triton_fwd)]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def f(be=be):
            with sdpa_kernel([be]):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                        enable_gqa=gqa > 1)
        rows.append((f"sdpa {name}", f))
    for tile in [t for t in tiles if (q.shape[-1], t) not in UNFIT]:
        for pers in PERSISTENT:
            for poly in EXP_POLYS:
                def w(tile=tile, pers=pers, poly=poly):
                    launch_ws.WS_TUNING["persistent"] = pers
                    launch_ws.WS_TUNING["exp_poly"] = {(False, q.shape[-1]): poly}
                    return _ws(q, k, v, causal, tile, scale)
                rows.append((f"ws{' P' if pers else ''} {tile[0]}x{tile[1]}x{tile[2]}{'p' if tile[3] else ''}"
                             f"{f' e{poly}' if poly else ''}", w))
    return rows


# how many of every 4 exponentials go to the FMA pipe (WS_TUNING["exp_poly"]) in the timed Gluon rows
EXP_POLYS = [0]
PERSISTENT = [True, False]


def bench_inputs(d: int, s: int, gqa: int):
    """``(B, H, q, k, v, g)`` of a timing case: 16k tokens, hidden 2048, bf16, ``g`` the generator (seed 0)."""
    H, B = 2048 // d, max(1, 16384 // s)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (H, H // gqa, H // gqa))
    return B, H, q, k, v, g


def bench(tiles, d_list, seqlens, gqa):
    import triton

    ensure_allocator(torch.device("cuda"))
    print(f"{'case':<28}{'impl':<18}{'ms':>8}{'TFLOP/s':>9}")
    for d in d_list:
        for s in seqlens:
            for causal in (False, True):
                B, H, q, k, v, _ = bench_inputs(d, s, gqa)
                fl = 4 * B * H * s * s * d / (2 if causal else 1)
                scale = d ** -0.5
                rows = _rows(q, k, v, causal, gqa, scale, tiles)
                case = f"d{d} s{s} {'causal' if causal else 'full'} g{gqa}"
                for name, fn in rows:
                    try:
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                        print(f"{case:<28}{name:<18}{ms:8.3f}{fl / ms / 1e9:9.1f}", flush=True)
                    except Exception as e:  # a backend that does not take this case
                        print(f"{case:<28}{name:<18}  failed: {type(e).__name__}: {str(e)[:120]}", flush=True)


def bench_fp8(tiles, d_list, seqlens):
    """FP8 forward (FA3's interface, quantized with descales): the Gluon FP8 kernel at each tile against the
    Triton FP8 forward and the bf16 (Gluon) forward of the same values; max |Gluon - Triton| of the output."""
    import triton

    from culmen.flash_attn import flash_attn_func
    from culmen.flash_attn_3 import flash_attn_func as fa3
    from culmen.flash_attn_3 import quantize_fp8
    from culmen.ops.attention.launch import _transposed_v
    from culmen.ops.common.plans import clear_plans

    ensure_allocator(torch.device("cuda"))
    print(f"{'case':<28}{'impl':<22}{'ms':>8}{'TFLOP/s':>9}  vs bf16")
    for d in d_list:
        for s in seqlens:
            for causal in (False, True):
                B, H, q, k, v, _ = bench_inputs(d, s, 1)
                q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
                fl = 4 * B * H * s * s * d / (2 if causal else 1)
                case = f"d{d} s{s} {'causal' if causal else 'full'}"
                f8 = partial(fa3, q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
                rows = [("bf16", None, partial(flash_attn_func, q, k, v, causal=causal)), ("fp8 triton", None, f8)]
                rows += [(f"fp8 ws {t[0]}x{t[1]}x{t[2]}{'p' if t[3] else ''}{'' if pers else ' np'}"
                          f"{f' e{poly}' if poly else ''}", (t, pers, poly), f8)
                         for t in tiles for pers in PERSISTENT for poly in EXP_POLYS]
                base = ref = None
                for what, v_copy in (("V transpose kernel", partial(_transposed_v, v8, False)),
                                     ("V transpose torch", v8.permute(0, 2, 3, 1).contiguous)):
                    ms = triton.testing.do_bench(v_copy, warmup=30, rep=200)
                    print(f"{case:<28}{what:<22}{ms:8.3f}  {2 * v8.numel() / ms / 1e6:7.0f} GB/s", flush=True)
                for name, tile, fn in rows:
                    launch_ws.WS_TUNING["fp8"] = tile is not None
                    if tile is not None:
                        tile, launch_ws.WS_TUNING["persistent"], poly = tile
                        launch_ws.WS_TUNING["exp_poly"] = {(True, d): poly}
                    if tile is not None:
                        launch_ws.WS_TUNING["tiles_fp8"] = {(d, causal): tile}
                    clear_plans()
                    try:
                        out = fn()
                        ms = triton.testing.do_bench(fn, warmup=30, rep=200)
                    except Exception as e:
                        print(f"{case:<28}{name:<22}  failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    base = base or ms
                    if name == "fp8 triton":
                        ref = out
                    diff = f"  max|ws - triton| {(out.float() - ref.float()).abs().max().item():.3g}" if (
                        tile is not None and ref is not None) else ""
                    print(f"{case:<28}{name:<22}{ms:8.3f}{fl / ms / 1e9:9.1f}  {base / ms:5.2f}x{diff}", flush=True)
    launch_ws.WS_TUNING["fp8"] = False
    launch_ws.WS_TUNING["persistent"] = True
    launch_ws.WS_TUNING["exp_poly"] = {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--seqlen", default="2048,8192")
    ap.add_argument("--tiles", default="128,3,2,0 128,3,2,1 128,2,3,0 128,2,3,1")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="time the FP8 forward (Gluon tiles vs Triton vs bf16)")
    ap.add_argument("--exp-poly", default="0", help="comma list: exponentials of every 4 on the FMA pipe "
                    "(-1: none at all, an ablation)")
    ap.add_argument("--persistent-only", action="store_true")
    ap.add_argument("--q-double", action="store_true", help="two Q buffers where they fit (WS_TUNING['q_double'])")
    a = ap.parse_args()
    launch_ws.WS_TUNING["q_double"] = a.q_double
    EXP_POLYS[:] = [int(x) for x in a.exp_poly.split(",")]
    if a.persistent_only:
        PERSISTENT[:] = [True]
    tiles = [tuple(int(x) for x in t.split(",")) for t in a.tiles.split()]
    tiles = [(t[0], t[1], t[2], bool(t[3])) for t in tiles]
    d_list = [int(x) for x in a.d.split(",")]
    if a.fp8:
        bench_fp8(tiles, d_list, [int(x) for x in a.seqlen.split(",")])
        return
    bad = check(tiles, d_list)
    print(f"check: {bad} bad")
    if not a.check_only:
        bench(tiles, d_list, [int(x) for x in a.seqlen.split(",")], a.gqa)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
