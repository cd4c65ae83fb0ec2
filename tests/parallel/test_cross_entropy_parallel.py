"""Vocab-parallel cross-entropy (flash_attn's ``process_group``) on 2 gloo ranks against one process.

Every rank builds the same full logits, keeps its half of the vocab (rank r: columns [r V/2, (r+1) V/2)),
and must get the single-process float64 losses and its slice of the full gradient, on both CPU paths
(reference and the Triton interpreter), with label smoothing, z-loss, logit scale, ignored rows and
labels in either rank's half, also with ``inplace_backward``, a precomputed LSE, the module's mean and the
op's reductions.
"""

from __future__ import annotations

from dist_harness import run_group


def _worker(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from culmen.flash_attn.losses.cross_entropy import CrossEntropyLoss
    from culmen.flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    from culmen.ops.backend import backend_mode, set_backend
    from culmen.ops.cross_entropy import cross_entropy, cross_entropy_ref

    failures: list[str] = []
    n, v_local = 11, 37  # odd sizes: V = 74 split 37 / 37
    v = v_local * world
    cols = slice(rank * v_local, (rank + 1) * v_local)

    def check(name, got, want, tol):
        err = (got.double() - want).abs().max().item()
        if not err <= tol:
            failures.append(f"rank {rank} {backend_mode()} {name}: max err {err:.3g} > {tol:g}")

    for backend in ("reference", "triton"):
        set_backend(backend)
        torch.manual_seed(1234)  # identical full tensors on every rank
        full = torch.randn(n, v) * 3.0
        labels = torch.randint(0, v, (n,))
        labels[::4] = -100
        labels[1], labels[2] = 0, v - 1  # one label in each rank's half at the edges
        kw = dict(label_smoothing=0.1, logit_scale=0.8, lse_square_scale=1e-3)
        full64 = full.double().requires_grad_()
        ref_loss, ref_z, _ = cross_entropy_ref(full64, labels, **kw)
        dy = torch.rand(n, dtype=torch.float64) + 0.5
        (ref_loss * dy).sum().backward()
        ref_grad = full64.grad[:, cols]

        for inplace in (False, True):
            shard = full[:, cols].clone().requires_grad_()
            loss, z = cross_entropy_loss(shard, labels, None, kw["label_smoothing"], kw["logit_scale"],
                                         kw["lse_square_scale"], -100, inplace, dist.group.WORLD)
            check(f"loss inplace={inplace}", loss, ref_loss.detach(), 1e-5)
            check(f"z_loss inplace={inplace}", z, ref_z, 1e-6)
            (loss * dy.float()).sum().backward()
            check(f"dlogits inplace={inplace}", shard.grad, ref_grad, 1e-6)

        # Precomputed global LSE (no smoothing, scale 1): used as given.
        full64b = full.double().requires_grad_()
        ref_b = cross_entropy_ref(full64b, labels)[0]
        ref_b.sum().backward()
        lse = torch.logsumexp(full, dim=-1)
        shard = full[:, cols].clone().requires_grad_()
        loss, _ = cross_entropy_loss(shard, labels, lse, process_group=dist.group.WORLD)
        check("loss precomputed_lse", loss, ref_b.detach(), 1e-5)
        loss.sum().backward()
        check("dlogits precomputed_lse", shard.grad, full64b.grad[:, cols], 1e-6)

        # The module's mean over non-ignored rows, 3-D input.
        shard = full[:, cols].clone().reshape(1, n, v_local).requires_grad_()
        mod = CrossEntropyLoss(process_group=dist.group.WORLD, label_smoothing=0.1)
        mean = mod(shard, labels.reshape(1, n))
        ref_m = cross_entropy_ref(full.double(), labels, label_smoothing=0.1)[0].sum() / (labels != -100).sum()
        check("module mean", mean.reshape(1), ref_m.reshape(1), 1e-6)
        mean.backward()
        full64m = full.double().requires_grad_()
        (cross_entropy_ref(full64m, labels, label_smoothing=0.1)[0].sum() / (labels != -100).sum()).backward()
        check("module mean dlogits", shard.grad.reshape(n, v_local), full64m.grad[:, cols], 1e-6)

        # The op's own reductions with a sharded vocab (reduced after the all-reduces).
        shard = full[:, cols].clone()
        total = cross_entropy(shard, labels, process_group=dist.group.WORLD, reduction="sum", **kw).loss
        check("op sum", total.reshape(1), ref_loss.detach().sum().reshape(1), 1e-4)
    return failures


def test_vocab_parallel_two_ranks():
    results = run_group(_worker, 2, env={"TRITON_INTERPRET": "1"}, timeout=240)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
