"""Tensor-parallel modules of ``culmen.flash_attn.modules`` on 2 gloo ranks equal the unsharded modules:
``ParallelMHA`` (MHA and GQA heads, an uneven split of the head groups, rotary, plain and flash paths,
sequence parallel or not, ALiBi slopes per rank), ``ParallelMLP``, ``ParallelGatedMlp``,
``VocabParallelEmbedding`` / ``ParallelGPT2Embeddings``, and a sequence-parallel ``Block`` built from them
(its norm gradients summed by ``allreduce_sequence_parallel_grad``). Forward outputs, input gradients and
every parameter's gradient (as this rank's shard of the full one) are compared in float64."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

F64 = torch.float64
TOL = 1e-10


def _err(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _run(full, par, x, g, sp, rank, world, seq_kw=None, par_call=None):
    """Forward + backward of the full module on the whole input and of the parallel one on this rank's
    part. Returns (errors dict, full module)."""
    xf = x.clone().requires_grad_()
    out_f = full(xf)
    out_f.backward(g)
    rows = x.flatten(0, 1).shape[0] // world
    sl = slice(rank * rows, (rank + 1) * rows)
    if sp:
        xl = x.flatten(0, 1)[sl].clone().requires_grad_()
        out = (par_call or par)(xl, **(seq_kw or {}))
        out.backward(g.flatten(0, 1)[sl])
        return {"out": _err(out, out_f.flatten(0, 1)[sl]), "dx": _err(xl.grad, xf.grad.flatten(0, 1)[sl])}
    xl = x.clone().requires_grad_()
    out = (par_call or par)(xl)
    out.backward(g)
    return {"out": _err(out, out_f), "dx": _err(xl.grad, xf.grad)}


def _groups(nkv, world):
    from culmen.flash_attn.utils.distributed import get_dim_for_local_rank

    return [get_dim_for_local_rank(nkv, world, r) for r in range(world)]


def _qkv_shard(t, nh, nkv, d, rank, world):
    """This rank's rows of a full ``Wqkv`` weight/bias: its query heads, then its k heads, then its v heads."""
    counts = _groups(nkv, world)
    k0, kl, grp = sum(counts[:rank]), counts[rank], nh // nkv
    q = t[:nh * d].unflatten(0, (nh, d))[k0 * grp:(k0 + kl) * grp].flatten(0, 1)
    k = t[nh * d:(nh + nkv) * d].unflatten(0, (nkv, d))[k0:k0 + kl].flatten(0, 1)
    v = t[(nh + nkv) * d:].unflatten(0, (nkv, d))[k0:k0 + kl].flatten(0, 1)
    return torch.cat([q, k, v])


def _out_cols(t, nh, nkv, d, rank, world):
    counts = _groups(nkv, world)
    grp = nh // nkv
    q0, ql = sum(counts[:rank]) * grp, counts[rank] * grp
    return t[:, q0 * d:(q0 + ql) * d]


def _load(par, full, shard):
    """Copy the shards of ``full``'s parameters into ``par`` (same names); return {name: shard fn}."""
    with torch.no_grad():
        for n, p in par.named_parameters():
            p.copy_(shard[n](dict(full.named_parameters())[n]))


def _grad_errs(par, full, shard, prefix=""):
    fp = dict(full.named_parameters())
    return {f"{prefix}d{n}": _err(p.grad, shard[n](fp[n].grad)) for n, p in par.named_parameters()}


def _mha_worker(rank, world):
    import torch.distributed as dist

    from culmen.flash_attn.modules.mha import MHA, ParallelMHA, get_alibi_slopes

    pg = dist.group.WORLD
    errs = {}
    d, B, S = 8, 2, 5
    for nh, nkv, sp, flash, rd in [(4, 4, True, False, 4), (4, 2, False, True, 0), (6, 3, True, True, 4),
                                   (4, 4, False, True, 8)]:
        e = nh * d
        torch.manual_seed(0)  # the same full weights, input and cotangent on every rank
        kw = dict(num_heads_kv=nkv, causal=True, rotary_emb_dim=rd, use_flash_attn=flash, dtype=F64)
        full = MHA(e, nh, **kw)
        # Drawn before the parallel module: its initialisation draws differently per rank (rank 0 alone
        # has the output bias).
        x, g = torch.randn(B, S, e, dtype=F64), torch.randn(B, S, e, dtype=F64)
        par = ParallelMHA(e, nh, pg, sequence_parallel=sp, **kw)
        qkv = partial(_qkv_shard, nh=nh, nkv=nkv, d=d, rank=rank, world=world)
        shard = {"Wqkv.weight": qkv, "Wqkv.bias": qkv,
                 "out_proj.weight": partial(_out_cols, nh=nh, nkv=nkv, d=d, rank=rank, world=world),
                 "out_proj.bias": lambda t: t}
        _load(par, full, shard)
        tag = f"nh={nh} nkv={nkv} sp={sp} flash={flash}"
        res = _run(full, par, x, g, sp, rank, world, seq_kw={"seqlen": S})
        res.update(_grad_errs(par, full, shard))
        errs.update({f"{tag} {k}": v for k, v in res.items()})
    # ALiBi: each rank holds the slopes of its own query heads.
    par = ParallelMHA(64, 8, pg, use_alibi=True, use_flash_attn=True)
    want = torch.tensor(get_alibi_slopes(8)[rank * 4:(rank + 1) * 4])
    errs["alibi slopes"] = _err(par.inner_attn.alibi_slopes, want)
    errs["heads per rank"] = float(par.num_heads_per_rank != 4)
    return errs


def _mlp_block_worker(rank, world):
    import torch.distributed as dist

    from culmen.flash_attn.modules.block import Block
    from culmen.flash_attn.modules.embedding import GPT2Embeddings, ParallelGPT2Embeddings, VocabParallelEmbedding
    from culmen.flash_attn.modules.mha import MHA, ParallelMHA
    from culmen.flash_attn.modules.mlp import GatedMlp, Mlp, ParallelGatedMlp, ParallelMLP
    from culmen.flash_attn.utils.distributed import allreduce_sequence_parallel_grad

    pg = dist.group.WORLD
    errs = {}
    e, hid, B, S = 12, 20, 2, 3

    def rows(t, n):
        return t[rank * n // world:(rank + 1) * n // world]

    for sp in (True, False):
        torch.manual_seed(0)
        full = Mlp(e, hid, activation=F.gelu, dtype=F64)
        x, g = torch.randn(B, S, e, dtype=F64), torch.randn(B, S, e, dtype=F64)
        par = ParallelMLP(e, hid, process_group=pg, sequence_parallel=sp, dtype=F64)
        shard = {"fc1.weight": lambda t: rows(t, hid), "fc1.bias": lambda t: rows(t, hid),
                 "fc2.weight": lambda t: rows(t.t(), hid).t(), "fc2.bias": lambda t: t}
        _load(par, full, shard)
        res = _run(full, par, x, g, sp, rank, world)
        res.update(_grad_errs(par, full, shard))
        errs.update({f"ParallelMLP sp={sp} {k}": v for k, v in res.items()})
        errs[f"ParallelMLP sp={sp} bias2 on rank 0 only"] = float((par.fc2.bias is None) != (rank != 0))

    for act in (F.silu, F.sigmoid):
        torch.manual_seed(1)
        full = GatedMlp(e, hid, activation=act, multiple_of=4, dtype=F64)
        x, g = torch.randn(B, S, e, dtype=F64), torch.randn(B, S, e, dtype=F64)
        par = ParallelGatedMlp(e, pg, hid, activation=act, multiple_of=4, dtype=F64)

        def gated_rows(t):
            return torch.cat([rows(t[:hid], hid), rows(t[hid:], hid)])

        shard = {"fc1.weight": gated_rows, "fc1.bias": gated_rows,
                 "fc2.weight": lambda t: rows(t.t(), hid).t(), "fc2.bias": lambda t: t}
        _load(par, full, shard)
        res = _run(full, par, x, g, True, rank, world)
        res.update(_grad_errs(par, full, shard))
        errs.update({f"ParallelGatedMlp {act.__name__} {k}": v for k, v in res.items()})

    # Embeddings: vocabulary rows and position columns per rank.
    vocab, npos = 10, 7
    for sp in (True, False):
        torch.manual_seed(2)
        full = GPT2Embeddings(e, vocab, npos, dtype=F64)
        ids = torch.randint(0, vocab, (B, S))
        g = torch.randn(B, S, e, dtype=F64)
        par = ParallelGPT2Embeddings(e, vocab, npos, pg, sequence_parallel=sp, dtype=F64)
        shard = {"word_embeddings.weight": lambda t: rows(t, vocab),
                 "position_embeddings.weight": lambda t: rows(t.t(), e).t()}
        _load(par, full, shard)
        out_f = full(ids)
        out_f.backward(g)
        if sp:
            out = par(ids, combine_batch_seqlen_dim=True)
            n = B * S // world
            out.backward(g.flatten(0, 1)[rank * n:(rank + 1) * n])
            errs["emb sp out"] = _err(out, out_f.flatten(0, 1)[rank * n:(rank + 1) * n])
        else:
            out = par(ids)
            out.backward(g)
            errs["emb out"] = _err(out, out_f)
        errs.update(_grad_errs(par, full, shard, f"emb sp={sp} "))
    v = VocabParallelEmbedding(vocab, 4, process_group=pg, dtype=F64)
    ids = torch.arange(vocab).view(2, 5)
    mine = (ids >= rank * 5) & (ids < rank * 5 + 5)
    got = v(ids)
    errs["vocab zeros elsewhere"] = got[~mine].abs().max().item()
    errs["vocab own rows"] = _err(got[mine], v.weight)

    # A sequence-parallel Block of ParallelMHA + ParallelMLP equals the unsharded Block; the norms'
    # partial gradients are summed by allreduce_sequence_parallel_grad.
    nh, d, hid2 = 4, 4, 24
    e2 = nh * d
    torch.manual_seed(3)
    full = Block(e2, partial(MHA, num_heads=nh, causal=True), partial(Mlp, hidden_features=hid2)).double()
    x, res_in = torch.randn(B, S, e2, dtype=F64), torch.randn(B, S, e2, dtype=F64)
    gh, gr = torch.randn(B, S, e2, dtype=F64), torch.randn(B, S, e2, dtype=F64)
    par = Block(e2, partial(ParallelMHA, num_heads=nh, process_group=pg, causal=True),
                partial(ParallelMLP, hidden_features=hid2, process_group=pg), sequence_parallel=True).double()
    ident = lambda t: t  # noqa: E731
    shard = {"mixer.Wqkv.weight": lambda t: _qkv_shard(t, nh, nh, d, rank, world),
             "mixer.Wqkv.bias": lambda t: _qkv_shard(t, nh, nh, d, rank, world),
             "mixer.out_proj.weight": lambda t: _out_cols(t, nh, nh, d, rank, world), "mixer.out_proj.bias": ident,
             "mlp.fc1.weight": lambda t: rows(t, hid2), "mlp.fc1.bias": lambda t: rows(t, hid2),
             "mlp.fc2.weight": lambda t: rows(t.t(), hid2).t(), "mlp.fc2.bias": ident,
             "norm1.weight": ident, "norm1.bias": ident, "norm2.weight": ident, "norm2.bias": ident}
    _load(par, full, shard)
    with torch.no_grad():
        for n in ("norm1", "norm2"):
            getattr(full, n).weight.add_(0.1)
            getattr(par, n).weight.add_(0.1)
    xf = x.clone().requires_grad_()
    hf, rf = full(xf, res_in)
    torch.autograd.backward([hf, rf], [gh, gr])
    n = B * S // world
    sl = slice(rank * n, (rank + 1) * n)
    xl = x.flatten(0, 1)[sl].clone().requires_grad_()
    h, r = par(xl, res_in.flatten(0, 1)[sl], mixer_kwargs={"seqlen": S})
    torch.autograd.backward([h, r], [gh.flatten(0, 1)[sl], gr.flatten(0, 1)[sl]])
    allreduce_sequence_parallel_grad(par, pg)
    errs["block h"] = _err(h, hf.flatten(0, 1)[sl])
    errs["block residual"] = _err(r, rf.flatten(0, 1)[sl])
    errs["block dx"] = _err(xl.grad, xf.grad.flatten(0, 1)[sl])
    errs.update(_grad_errs(par, full, shard, "block "))
    return errs


def _check(results, expected_keys_min):
    for rank, errs in enumerate(results):
        assert len(errs) >= expected_keys_min, errs
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_parallel_mha_two_gloo_ranks():
    _check(run_group(_mha_worker, 2), 4 * 5 + 2)  # rank 1 holds no out_proj bias


def test_parallel_mlp_embedding_block_two_gloo_ranks():
    _check(run_group(_mlp_block_worker, 2), 30)
