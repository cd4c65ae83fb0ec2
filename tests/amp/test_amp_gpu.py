"""culmen.amp on CUDA at real sizes: fp16 O1 casts, O1 against torch.autocast + GradScaler, O2 with
culmen's FusedAdam against fp32, overflow skipping, one host sync per step, bit-identical resume."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from amp_testutils import MLP, clean_amp, make_data  # noqa: F401 - clean_amp is an autouse fixture
from torch import nn

from culmen import amp
from culmen.amp._amp_state import _amp_state

pytestmark = pytest.mark.gpu
DEV = "cuda"


class TinyGPT(nn.Module):
    def __init__(self, vocab=1000, seq=256, d=256, heads=4, layers=4):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.fc = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](self.ln1[i](x)).chunk(3, dim=-1)
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            x = x + self.proj[i](y)
            x = x + self.out[i](F.gelu(self.fc[i](self.ln2[i](x)), approximate="tanh"))
        return self.head(self.ln_f(x))


def _gpt_batch(vocab=1000, batch=8, seq=256):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    # a learnable target: the next token is a fixed function of the current one
    return idx.to(DEV), ((idx * 7 + 3) % vocab).to(DEV)


def test_fp16_o1_casts_on_cuda():
    torch.manual_seed(0)
    model = MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x = torch.randn(64, 128, device=DEV)
    w = torch.randn(128, 128, device=DEV)
    assert F.linear(x, w).dtype == torch.float16 and (x @ w).dtype == torch.float16
    h = x.half()
    assert F.softmax(h, 1).dtype == torch.float32 and F.layer_norm(h, (128,)).dtype == torch.float32
    assert h.std().dtype == torch.float32 and torch.var(h, 1).dtype == torch.float32  # culmen's additions
    assert h.sum().dtype == torch.float32 and torch.exp(h).dtype == torch.float32
    assert torch.relu(h).dtype == torch.float16
    assert torch.cat([h, x]).dtype == torch.float32
    grid = torch.rand(1, 4, 4, 2, device=DEV).half() * 2 - 1
    assert F.grid_sample(torch.randn(1, 1, 8, 8, device=DEV).half(), grid, align_corners=False).dtype == torch.float32
    assert h.cpu().dtype == torch.float32  # Apex: fp32 before leaving the GPU
    with amp.disable_casts():
        assert h.cpu().dtype == torch.float16
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(torch.rand(8, device=DEV).half(), torch.rand(8, device=DEV))
    assert F.binary_cross_entropy(torch.rand(8, device=DEV), torch.rand(8, device=DEV)).dtype == torch.float32
    assert model(torch.randn(16, 12, device=DEV)).dtype == torch.float16


def _torch_amp_run(steps, idx, tgt):
    torch.manual_seed(0)
    model = TinyGPT().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def _amp_run(steps, idx, tgt, level, opt_factory=None, **kw):
    torch.manual_seed(0)
    model = TinyGPT().to(DEV)
    opt = (opt_factory or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_o1_tracks_torch_autocast_gradscaler():
    idx, tgt = _gpt_batch()
    ref = _torch_amp_run(40, idx, tgt)
    ours = _amp_run(40, idx, tgt, "O1")
    assert ours[-1] < ours[0] / 3
    # Same casts (torch.autocast) and the same dynamic scale rule: the curves agree to fp16 noise.
    assert abs(ours[-1] - ref[-1]) <= 0.05 * ref[-1] + 1e-2, (ours[-1], ref[-1])
    assert abs(ours[0] - ref[0]) <= 1e-3 * ref[0]


@pytest.mark.parametrize("level, kw", [("O2", {}), ("O5", {}), ("O4", {})])
def test_o2_fused_adam_matches_fp32(level, kw):
    from culmen.optimizers import FusedAdam

    idx, tgt = _gpt_batch()
    torch.manual_seed(0)
    model = TinyGPT().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = []
    for _ in range(40):
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        ref.append(loss.item())
    ours = _amp_run(40, idx, tgt, level, opt_factory=lambda p: FusedAdam(p, lr=1e-3), **kw)
    assert all(torch.isfinite(torch.tensor(ours)))
    assert abs(ours[-1] - ref[-1]) <= 0.1 * ref[-1] + 2e-2, (level, ours[-1], ref[-1])


def _make_opt(kind, params):
    if kind == "culmen":
        from culmen.optimizers import FusedAdam

        return FusedAdam(params, lr=1e-3)
    return torch.optim.Adam(params, lr=1e-3, fused=kind == "fused")


@pytest.mark.parametrize("kind, syncs", [("plain", 1), ("fused", 0), ("culmen", 0)])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skip_and_host_syncs_on_cuda(kind, syncs, level):
    """At most one host sync per step (the overflow flag), none with an optimizer that skips on the device."""
    x, y = make_data(n=4096, d_in=12, d_out=5, device=DEV)
    torch.manual_seed(0)
    model = MLP(d_hidden=1024).to(DEV)
    model, opt = amp.initialize(model, _make_opt(kind, model.parameters()), opt_level=level, verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scaler._loss_scale = 1024.0

    def step(poison=None):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        loss = loss * poison if poison is not None else loss
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    step()
    step()
    scaler.loss_scale()
    before = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    step(float("inf"))
    assert scaler.loss_scale() == 512.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    cm = amp.scale_loss(loss, opt)
    cm.__enter__().backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            cm.__exit__(None, None, None)  # unscale + overflow check of every gradient
            if syncs == 0:
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [str(w.message) for w in rec if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(found) == syncs, found
    if syncs:
        opt.step()
    step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_checkpoint_resume_bit_identical_on_cuda():
    x, y = make_data(n=2048, device=DEV)

    def setup(seed):
        torch.manual_seed(seed)
        model = MLP(d_hidden=512).to(DEV)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return amp.initialize(model, opt, opt_level="O2", verbosity=0)

    def step(model, opt, i):
        opt.zero_grad()
        loss = F.mse_loss(model(x[i % 2::2]), y[i % 2::2])
        with amp.scale_loss(loss * (float("inf") if i == 2 else 1.0), opt) as scaled:
            scaled.backward()
        opt.step()
        return loss.detach()

    model, opt = setup(0)
    full = [step(model, opt, i) for i in range(10)]
    amp.deinitialize()
    model, opt = setup(0)
    part = [step(model, opt, i) for i in range(5)]
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict(), "a": amp.state_dict()}, buf)
    amp.deinitialize()
    model, opt = setup(7)
    ck = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model.load_state_dict(ck["m"])
    opt.load_state_dict(ck["o"])
    amp.load_state_dict(ck["a"])
    part += [step(model, opt, i) for i in range(5, 10)]
    assert torch.equal(torch.stack(part), torch.stack(full))
