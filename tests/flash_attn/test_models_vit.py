"""``culmen.flash_attn.layers.patch_embed.PatchEmbed`` against ``conv2d`` and
``culmen.flash_attn.models.vit.VisionTransformer`` against a plain-PyTorch timm-style ViT written here
(pre-norm blocks, final norm, class-token head) run on the same weights: outputs and the gradients of
the image and every parameter, in float64 vs fp32 (CPU) and fp16 / bf16 (GPU), plus timm checkpoint
loading, the init scheme and argument errors."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from culmen.flash_attn.layers.patch_embed import PatchEmbed
from culmen.flash_attn.models import vit
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

F32, F64 = torch.float32, torch.float64


# ----------------------------------------------------------------------------------- PatchEmbed


def _conv_patch_embed(x, weight, bias, patch):
    """The timm definition: a stride-``patch`` conv, flattened to ``(B, patches, D)``."""
    w = weight.reshape(weight.shape[0], x.shape[1], *patch)
    return F.conv2d(x, w, bias, stride=patch).flatten(2).transpose(1, 2)


def _check_against(fn_actual, fn_ref, inputs, dtype, name):
    """Run ``fn_actual(*inputs)`` and ``fn_ref`` on float64 and ``dtype`` copies; compare outputs and grads."""
    out = fn_actual(*inputs)
    g = randn(out.shape, F32).to(out.dtype)
    got = (out, *torch.autograd.grad(out, inputs, g))
    refs = []
    for ref_dtype in (F64, dtype):
        cp = [t.detach().to(ref_dtype).requires_grad_() for t in inputs]
        r = fn_ref(*cp)
        refs.append((r, *torch.autograd.grad(r, cp, g.to(ref_dtype))))
    for i, (a, rh, rl) in enumerate(zip(got, *refs)):
        assert torch.isfinite(a).all(), f"{name}: output {i} has non-finite values"
        assert_close_tolerance(a, rh, rl, name=f"{name} [{i}]")


@pytest.mark.parametrize("img,patch,bias,fused", [
    ((12, 20), (4, 5), True, False),
    ((14, 14), (7, 7), False, False),
    ((15, 9), (3, 3), True, True),
])
def test_patch_embed_matches_conv(img, patch, bias, fused):
    torch.manual_seed(1)
    pe = PatchEmbed(img_size=img, patch_size=patch, in_chans=3, embed_dim=19, bias=bias, fused_bias_fc=fused)
    assert pe.num_patches == (img[0] // patch[0]) * (img[1] // patch[1])
    assert pe.proj.weight.shape == (19, 3 * patch[0] * patch[1])
    if not bias:
        assert pe.proj.bias is None
    x = make_noncontiguous(randn((2, 3, *img), F32)).requires_grad_()
    params = [pe.proj.weight] + ([pe.proj.bias] if bias else [])

    def actual(x, *ps):
        return pe(x)

    def ref(x, w, b=None):
        return _conv_patch_embed(x, w, b, patch)

    _check_against(actual, ref, [x, *params], F32, f"patch_embed {img} {patch}")


def test_patch_embed_unflattened_norm_and_crop():
    torch.manual_seed(2)
    # 13 is not a multiple of 4: the last row of pixels is dropped, as a strided conv drops it.
    pe = PatchEmbed(img_size=(13, 8), patch_size=4, in_chans=2, embed_dim=6, flatten=False,
                    norm_layer=partial(nn.LayerNorm, eps=1e-6))
    with torch.no_grad():
        pe.norm.weight.normal_()
        pe.norm.bias.normal_()
    assert pe.grid_size == (3, 2) and pe.patch_size == (4, 4) and pe.img_size == (13, 8)
    x = randn((3, 2, 13, 8), F64)
    pe = pe.double()
    y = pe(x)
    assert y.shape == (3, 3, 2, 6)
    ref = _conv_patch_embed(x, pe.proj.weight, pe.proj.bias, (4, 4))
    ref = F.layer_norm(ref, (6,), pe.norm.weight, pe.norm.bias, 1e-6).reshape(3, 3, 2, 6)
    assert_close_tolerance(y, ref, None, name="unflattened + norm")


def test_patch_embed_errors():
    pe = PatchEmbed(img_size=8, patch_size=4, in_chans=1, embed_dim=4)
    with pytest.raises(ValueError, match="doesn't match"):
        pe(torch.randn(1, 1, 8, 12))
    with pytest.raises(ValueError, match="patch_size"):
        PatchEmbed(img_size=8, patch_size=0)
    with pytest.raises(ValueError, match="larger than img_size"):
        PatchEmbed(img_size=8, patch_size=16)


# ------------------------------------------------------------------------------------------ ViT

VisionTransformer = vit.VisionTransformer

TINY = dict(img_size=(12, 20), patch_size=(4, 5), in_chans=3, num_classes=7, embed_dim=32, depth=2, num_heads=2,
            mlp_ratio=2.5)


def _vit_reference(p: dict, x, *, patch, heads, depth, no_embed_class, eps=1e-6, act=F.gelu, all_tokens=False,
                   head=True):
    """timm's ViT on the weights ``p`` (culmen's names): conv patchify, class token, pre-norm blocks,
    final norm; returns the head's logits of the class token (or all tokens' normalized features)."""
    d = p["pos_embed"].shape[-1]
    b = x.shape[0]
    h = _conv_patch_embed(x, p["patch_embed.proj.weight"], p.get("patch_embed.proj.bias"), patch)
    cls = p["cls_token"].expand(b, -1, -1)
    h = torch.cat((cls, h + p["pos_embed"]), 1) if no_embed_class else torch.cat((cls, h), 1) + p["pos_embed"]
    for i in range(depth):
        pre = f"blocks.{i}."
        y = F.layer_norm(h, (d,), p[pre + "norm1.weight"], p[pre + "norm1.bias"], eps)
        if pre + "mixer.Wqkv.weight" in p:
            qkv = F.linear(y, p[pre + "mixer.Wqkv.weight"], p.get(pre + "mixer.Wqkv.bias"))
        else:  # the cross-attention form of the last block holds the same projection in two parts
            qkv = torch.cat([F.linear(y, p[pre + "mixer.Wq.weight"], p.get(pre + "mixer.Wq.bias")),
                             F.linear(y, p[pre + "mixer.Wkv.weight"], p.get(pre + "mixer.Wkv.bias"))], -1)
        q, k, v = qkv.reshape(b, -1, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1) @ v
        att = att.transpose(1, 2).reshape(b, -1, d)
        h = h + F.linear(att, p[pre + "mixer.out_proj.weight"], p[pre + "mixer.out_proj.bias"])
        y = F.layer_norm(h, (d,), p[pre + "norm2.weight"], p[pre + "norm2.bias"], eps)
        y = F.linear(act(F.linear(y, p[pre + "mlp.fc1.weight"], p[pre + "mlp.fc1.bias"])),
                     p[pre + "mlp.fc2.weight"], p[pre + "mlp.fc2.bias"])
        h = h + y
    h = F.layer_norm(h, (d,), p["norm.weight"], p["norm.bias"], eps)
    if all_tokens:
        return h
    return F.linear(h[:, 0], p["head.weight"], p["head.bias"]) if head else h[:, 0]


def _randomize_(model):
    # O(1) activations (the init's std 0.02 weights make every output tiny and insensitive) and
    # non-default norms and biases, so a swapped or skipped piece changes the result.
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("weight") and prm.dim() == 2:
                prm.normal_(0.0, prm.shape[1] ** -0.5)
            elif name.endswith("bias") or "norm" in name:
                prm.add_(torch.randn_like(prm) * 0.3)
            else:  # cls_token, pos_embed
                prm.normal_()
    return model


def _compare_vit(model, x, dtype, ref_kwargs, *, all_tokens=False, name=""):
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    out = model.forward_features(x, all_tokens=True) if all_tokens else model(x)
    g = randn(out.shape, F32, device=x.device).to(out.dtype)
    # all_tokens features never reach the classifier head: its parameters get no gradient on either side.
    got = (out, *torch.autograd.grad(out, [x, *params], g, allow_unused=True))
    refs = []
    for ref_dtype in (F64, dtype):
        xr = x.detach().to(ref_dtype).requires_grad_()
        pr = {n: p.detach().to(ref_dtype).requires_grad_() for n, p in zip(names, params)}
        r = _vit_reference(pr, xr, all_tokens=all_tokens, **ref_kwargs)
        refs.append((r, *torch.autograd.grad(r, [xr, *pr.values()], g.to(ref_dtype), allow_unused=True)))
    labels = ["out", "d_image", *[f"d_{n}" for n in names]]
    for label, a, rh, rl in zip(labels, got, *refs):
        if rh is None:
            assert a is None or not a.any(), f"{name} {label}: gradient where the reference has none"
            continue
        assert a is not None and torch.isfinite(a).all(), f"{name} {label}"
        assert_close_tolerance(a, rh, rl, name=f"{name} {label}")


@pytest.mark.parametrize("use_flash_attn,no_embed_class,fused", [
    (False, False, False),
    (True, True, False),
    (True, False, True),
])
def test_vit_matches_plain_vit(use_flash_attn, no_embed_class, fused):
    torch.manual_seed(3)
    model = _randomize_(VisionTransformer(**TINY, use_flash_attn=use_flash_attn, no_embed_class=no_embed_class,
                                          fused_bias_fc=fused, fused_mlp=fused, fused_dropout_add_ln=fused))
    assert model.blocks[-1].mixer.cross_attn and not model.blocks[0].mixer.cross_attn
    model.eval()
    x = randn((2, 3, 12, 20), F32).requires_grad_()
    act = partial(F.gelu, approximate="tanh") if fused else F.gelu
    ref_kwargs = dict(patch=(4, 5), heads=2, depth=2, no_embed_class=no_embed_class, act=act)
    _compare_vit(model, x, F32, ref_kwargs, name=f"vit flash={use_flash_attn} fused={fused}")


def test_vit_all_tokens_features_and_heads():
    torch.manual_seed(4)
    model = _randomize_(VisionTransformer(**{**TINY, "num_classes": 0}, drop_rate=0.2, drop_path_rate=0.3))
    assert isinstance(model.head, nn.Identity)
    model.eval()  # dropout and drop path off: the plain ViT's function
    x = randn((3, 3, 12, 20), F32).requires_grad_()
    ref_kwargs = dict(patch=(4, 5), heads=2, depth=2, no_embed_class=False)
    _compare_vit(model, x, F32, ref_kwargs, all_tokens=True, name="all tokens")
    with torch.no_grad():
        feats = model(x)
        p = {n: t.double() for n, t in model.state_dict().items()}
        ref = _vit_reference(p, x.double(), head=False, **ref_kwargs)
        assert feats.shape == (3, 32)
        assert_close_tolerance(feats, ref, _vit_reference({n: t.float() for n, t in p.items()}, x.detach(),
                                                          head=False, **ref_kwargs), name="num_classes=0")
        full = model.forward_features(x, all_tokens=True)
        assert torch.equal(model.forward_head(full, pre_logits=True), full[:, 0])
    # Training mode drops rows: the output changes, and stays finite.
    model.train()
    with torch.no_grad():
        outs = [model(x) for _ in range(2)]
    assert not torch.equal(outs[0], outs[1]) and all(torch.isfinite(o).all() for o in outs)
    assert [b.drop_path2.p for b in model.blocks] == pytest.approx([0.0, 0.3])
    assert model.drop_path.p == pytest.approx(0.3)
    # The fused dropout + add + LayerNorm path takes drop path as a per-sample rowscale.
    fused = VisionTransformer(**TINY, drop_rate=0.2, drop_path_rate=0.5, fused_dropout_add_ln=True).train()
    with torch.no_grad():
        outs = [fused(x) for _ in range(2)]
        assert not torch.equal(outs[0], outs[1]) and all(torch.isfinite(o).all() for o in outs)
        fused.eval()
        assert torch.equal(fused(x), fused(x))


def test_vit_loads_timm_checkpoint():
    torch.manual_seed(5)
    src = _randomize_(VisionTransformer(**TINY))
    d = TINY["embed_dim"]
    timm_sd = {}
    for k, v in src.state_dict().items():
        k2 = k.replace("mixer.out_proj", "attn.proj").replace("mixer.Wqkv", "attn.qkv")
        timm_sd[k2] = v.clone()
    last = "blocks.1."
    for kind in ("weight", "bias"):  # timm keeps one qkv projection in every block
        timm_sd[f"{last}attn.qkv.{kind}"] = torch.cat([timm_sd.pop(f"{last}mixer.Wq.{kind}"),
                                                      timm_sd.pop(f"{last}mixer.Wkv.{kind}")])
    timm_sd["patch_embed.proj.weight"] = timm_sd["patch_embed.proj.weight"].reshape(d, 3, 4, 5)
    keys_before = set(timm_sd)
    dst = VisionTransformer(**TINY)
    dst.load_state_dict(timm_sd)
    assert set(timm_sd) == keys_before  # the caller's mapping is untouched
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    x = randn((2, 3, 12, 20), F32)
    src.eval()
    dst.eval()
    with torch.no_grad():
        assert torch.equal(src(x), dst(x))


def test_vit_init_and_names():
    torch.manual_seed(6)
    m = VisionTransformer(**{**TINY, "embed_dim": 64, "depth": 3, "num_heads": 4})
    sd = m.state_dict()
    assert sd["pos_embed"].shape == (1, 1 + 12, 64) and sd["cls_token"].shape == (1, 1, 64)
    assert sd["patch_embed.proj.weight"].shape == (64, 60)
    assert "blocks.0.mixer.Wqkv.weight" in sd and "blocks.2.mixer.Wq.weight" in sd and "blocks.2.mixer.Wkv.bias" in sd
    assert {"norm.weight", "head.weight", "blocks.1.mlp.fc1.bias", "blocks.1.norm2.weight"} <= set(sd)
    assert m.no_weight_decay() == {"pos_embed", "cls_token"}
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert all(lin.bias is None or not lin.bias.any() for lin in linears)
    w = torch.cat([lin.weight.flatten() for lin in linears])
    assert 0.015 < w.std().item() < 0.025 and w.abs().max().item() < 0.2
    assert sd["cls_token"].abs().max().item() < 1e-4 and sd["cls_token"].abs().max().item() > 0
    assert 0.015 < sd["pos_embed"].std().item() < 0.025
    assert torch.equal(sd["norm.weight"], torch.ones(64)) and torch.equal(sd["norm.bias"], torch.zeros(64))
    no_embed = VisionTransformer(**TINY, no_embed_class=True)
    assert no_embed.pos_embed.shape == (1, 12, 32)


def test_vit_base_and_errors():
    m = vit.vit_base_patch16_224(num_classes=5, depth=1)
    assert m.patch_embed.num_patches == 196 and m.embed_dim == 768 and m.head.out_features == 5
    assert m.blocks[0].mixer.num_heads == 12
    for bad in (dict(global_pool="avg"), dict(class_token=False), dict(init_values=1e-5), dict(weight_init="jax"),
                dict(fc_norm=True), dict(pre_norm=True)):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            VisionTransformer(**TINY, **bad)
    with pytest.raises(ValueError, match="pretrained"):
        vit.vit_base_patch16_224(pretrained=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_vit_gpu_low_precision(dtype, fused):
    torch.manual_seed(7)
    cfg = dict(img_size=(48, 40), patch_size=(8, 8), in_chans=3, num_classes=11, embed_dim=128, depth=3,
               num_heads=2, mlp_ratio=3.0)
    model = _randomize_(VisionTransformer(**cfg, use_flash_attn=True, fused_bias_fc=fused, fused_mlp=fused,
                                          fused_dropout_add_ln=fused)).cuda().to(dtype)
    model.eval()
    x = randn((3, 3, 48, 40), dtype, device="cuda").requires_grad_()
    act = partial(F.gelu, approximate="tanh") if fused else F.gelu
    ref_kwargs = dict(patch=(8, 8), heads=2, depth=3, no_embed_class=False, act=act)
    _compare_vit(model, x, dtype, ref_kwargs, name=f"vit gpu {dtype} fused={fused}")
    _compare_vit(model, x, dtype, ref_kwargs, all_tokens=True, name=f"vit gpu all tokens {dtype}")
