"""Which fp32 rounding each op of torch.optim.Adam's single-tensor CUDA step has (run on the GPU machine).

    python3 scripts/probe_torch_adam_rounding.py

For every op ``_single_tensor_adam`` runs (``mul_`` / ``lerp_`` / ``addcmul_`` / ``div`` by a host scalar /
``add_`` / ``addcdiv_``), on 4M random fp32 values, the fraction of elements on which torch's CUDA result
equals each candidate formula, evaluated in float64 and rounded to fp32 once per step of the formula
(``fma`` rounds once). tests/optimizers/test_adam_rounding.py's emulation takes the candidates that match
(1.000000).
"""

from __future__ import annotations

import torch


def r(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def s(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def main() -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    n = 1 << 22

    def rnd(lo=-1.0, hi=1.0):
        return torch.rand(n, device=dev, generator=g) * (hi - lo) + lo

    def report(name, got, cands):
        got = got.double()
        line = " ".join(f"{k}={(got == c).double().mean().item():.6f}" for k, c in cands.items())
        print(f"{name:28} {line}", flush=True)

    a, b, c = rnd(), rnd(), rnd()
    for al in (1 - 0.999, 1 - 0.99, 1 - 0.9):
        A = s(al)
        ad, bd, cd = a.double(), b.double(), c.double()
        report(f"addcmul value={al:.3g}", torch.addcmul(a, b, c, value=al), {
            "fma(al,r(bc),a)": r(A * r(bd * cd) + ad), "fma(r(al*b),c,a)": r(r(A * bd) * cd + ad),
            "r(a+r(al*r(bc)))": r(ad + r(A * r(bd * cd))), "r(a+r(r(al*b)*c))": r(ad + r(r(A * bd) * cd)),
            "fma(al*b exact)": r(A * bd * cd + ad)})
    v = rnd(0.0, 1.0)
    for b2 in (0.999, 0.99):
        report(f"mul_ {b2}", v.clone().mul_(b2), {"r(v*b32)": r(v.double() * s(b2)), "r(v*b64)": r(v.double() * b2)})
    for bc in (0.001, 0.0019990005, 0.05):
        bcs = bc ** 0.5
        report(f"div host scalar {bcs:.4g}", v / bcs, {
            "r(v/b32)": r(v.double() / s(bcs)), "r(v*r(1/b32))": r(v.double() * s(1.0 / s(bcs))),
            "r(v*r(1/b64))": r(v.double() * s(1.0 / bcs)), "r(v/b64)": r(v.double() / bcs)})
    for eps in (1e-8, 3e-6):
        report(f"add_ eps {eps}", v.clone().add_(eps), {"r(v+e32)": r(v.double() + s(eps)),
                                                         "r(v+e64)": r(v.double() + eps)})
    m, gg = rnd(), rnd()
    for w in (1 - 0.9, 1 - 0.6, 1 - 0.3):
        W = s(w)
        md, gd = m.double(), gg.double()
        d = r(gd - md)
        report(f"lerp_ weight={w:.3g}", m.clone().lerp_(gg, w), {
            "fma(w,d,m)": r(W * d + md), "fma(w-1,d,g)": r((W - 1.0) * d + gd),
            "r(m+r(w*d))": r(md + r(W * d)), "r(g-r(d*r(1-w)))": r(gd - r(d * s(1.0 - W)))})
    p, den = rnd(), rnd(1e-3, 1.0)
    for val in (-5e-4, -1e-3 / (1 - 0.9), -0.01):
        V = s(val)
        pd, md, dd = p.double(), m.double(), den.double()
        report(f"addcdiv value={val:.3g}", p.clone().addcdiv_(m, den, value=val), {
            "fma(v,r(m/d),p)": r(V * r(md / dd) + pd), "r(p+r(v*r(m/d)))": r(pd + r(V * r(md / dd))),
            "fma(r(v*m)/d)": r(r(V * md) / dd + pd), "r(p+r(r(v*m)/d))": r(pd + r(r(V * md) / dd))})
    for dec in (1 - 1e-3 * 0.01, 1 - 0.01 * 0.1):
        report(f"mul_ decay {dec:.8g}", p.clone().mul_(dec), {"r(p*d32)": r(p.double() * s(dec))})
    sq = v.sqrt()
    report("sqrt", sq, {"r(sqrt)": r(v.double().sqrt())})
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
