"""culmen.integrations.huggingface.patch on tiny random models of every supported family (no downloads):
patched vs unpatched logits, loss and the gradient of every parameter under the tolerance rule (float64
reference model with a plain-math attention written here), greedy generate, the report, idempotence."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

import culmen.integrations.huggingface as culmen_hf  # noqa: E402
from culmen.integrations.hf_patch import KINDS, CulmenActivation, culmen_apply_rotary_pos_emb  # noqa: E402
from culmen.testing.tolerance import assert_close_tolerance, default_atol  # noqa: E402

V = 96
GATED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
FAMILIES = GATED + ("gpt2", "gpt_neox", "opt")


def config(family: str):
    """A ~2-layer, hidden-32 config of ``family`` exercising its particular features (GQA, sliding windows,
    softcaps, zero-centred norms, q/k norms, partial rotary, fused gate/up, learned positions)."""
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.2,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    T = transformers
    if family == "llama":
        return T.LlamaConfig(**common, intermediate_size=48, num_key_value_heads=2)
    if family == "mistral":
        return T.MistralConfig(**common, intermediate_size=48, num_key_value_heads=2, sliding_window=4)
    if family == "qwen2":
        return T.Qwen2Config(**common, intermediate_size=48, num_key_value_heads=2, use_sliding_window=True,
                             sliding_window=4, max_window_layers=1)
    if family == "qwen3":
        return T.Qwen3Config(**common, intermediate_size=48, num_key_value_heads=2, head_dim=16)
    if family == "gemma":
        return T.GemmaConfig(**common, intermediate_size=48, num_key_value_heads=1, head_dim=8,
                             hidden_activation="gelu_pytorch_tanh")
    if family == "gemma2":
        return T.Gemma2Config(**common, intermediate_size=48, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              query_pre_attn_scalar=12, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "gemma3":
        return T.Gemma3TextConfig(**common, intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                  sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=8)
    if family == "phi3":
        return T.Phi3Config(**common, intermediate_size=48, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0,
                            rope_parameters=rope)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
                            eos_token_id=None)
    if family == "gpt_neox":
        return T.GPTNeoXConfig(**common, intermediate_size=48, hidden_dropout=0.0, rope_parameters=rope)
    assert family == "opt"
    return T.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                       max_position_embeddings=64, dropout=0.0, init_std=0.2, pad_token_id=0, bos_token_id=1,
                       eos_token_id=None, word_embed_proj_dim=32)


EXPECTED = {  # what patch() finds in each config above
    "llama": dict(rms_norm=5, rotary=2, mlp=2), "mistral": dict(rms_norm=5, rotary=2, mlp=2),
    "qwen2": dict(rms_norm=5, rotary=2, mlp=2), "qwen3": dict(rms_norm=9, rotary=2, mlp=2),
    "gemma": dict(rms_norm=5, rotary=2, mlp=2), "gemma2": dict(rms_norm=9, rotary=2, mlp=2),
    "gemma3": dict(rms_norm=13, rotary=2, mlp=2), "phi3": dict(rms_norm=5, rotary=2, mlp=2),
    "gpt2": dict(layer_norm=5, activation=2), "gpt_neox": dict(layer_norm=5, rotary=2, activation=2),
    "opt": dict(layer_norm=5, activation=2),
}


# ------------------------------------------------------------- float64 reference attention (plain math)


def _oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, **kwargs):
    """Attention written out in the inputs' dtype with transformers' 4-D bool mask; rows that see no key
    give 0 (transformers' eager attention overflows to NaN there in float64)."""
    h, hk = query.shape[1], key.shape[1]
    k, v = key.repeat_interleave(h // hk, 1), value.repeat_interleave(h // hk, 1)
    s = query @ k.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keep = attention_mask
    if keep is None:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(s.shape[-1] - s.shape[-2])
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2), None


def _oracle_mask(**kwargs):
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(allow_is_causal_skip=False, **kwargs)


transformers.AttentionInterface.register("culmen_patch_oracle", _oracle_attention)
AttentionMaskInterface.register("culmen_patch_oracle", _oracle_mask)


def models(family: str, dtype=torch.float32, device="cpu", hi_dtype=torch.float64):
    """``(patched, reference, high-precision reference, report)`` sharing one set of random weights."""
    ref = AutoModelForCausalLM.from_config(config(family), attn_implementation="eager").to(device, dtype)
    hi = copy.deepcopy(ref).to(hi_dtype)
    hi.set_attn_implementation("culmen_patch_oracle")
    mod = copy.deepcopy(ref)
    report = culmen_hf.patch(mod)
    for m in (ref, hi, mod):
        m.generation_config.pad_token_id = 0
    return mod, ref, hi, report


def padded_batch(device="cpu", B=3, S=9):
    ids = torch.randint(3, V, (B, S), device=device)
    mask = torch.ones(B, S, dtype=torch.long, device=device)
    mask[0, :3] = 0  # left padding
    mask[-1, S - 3:] = 0  # right padding
    # No label is predicted from a padding position (outputs there differ between attention implementations).
    prev = torch.nn.functional.pad(mask[:, :-1], (1, 0))
    return ids, mask, ids.masked_fill((mask == 0) | (prev == 0), -100)


def check_training(mod, ref, hi, device="cpu"):
    """Loss (fused linear + CE in the patched model, logits None), logits at valid positions (a call
    without labels) and every parameter's gradient, within the tolerance rule.

    In bf16 the gradients are compared as one vector in the L2 norm, with a floor of 2% of its norm: a
    whole model's bf16 gradients are chaotic (a rounding difference upstream flips a ReLU or reorders a
    softmax and moves single entries far more than any one kernel's error), so entry-wise maxima of two
    equally valid bf16 models routinely differ by several times. Real faults move the norm by O(1).
    """
    ids, mask, labels = padded_batch(device)
    outs = {}
    for name, m in (("mod", mod), ("ref", ref), ("hi", hi)):
        m.train()
        o = m(ids, attention_mask=mask, labels=labels)
        o.loss.backward()
        with torch.no_grad():
            logits = m(ids, attention_mask=mask).logits
        outs[name] = (o, logits)
    low = next(ref.parameters()).dtype
    assert outs["mod"][0].logits is None and outs["ref"][0].logits is not None
    # The loss is fp32 whatever the model's dtype; its rounding noise is that of the model's dtype.
    loss_atol = default_atol(low) * max(1.0, abs(outs["hi"][0].loss.item()))
    assert_close_tolerance(outs["mod"][0].loss, outs["hi"][0].loss, outs["ref"][0].loss, atol=loss_atol, name="loss")
    valid = mask.bool()
    assert_close_tolerance(outs["mod"][1][valid], outs["hi"][1][valid], outs["ref"][1][valid], name="logits")
    grads = []
    for (name, p), p_ref, p_hi in zip(mod.named_parameters(), ref.parameters(), hi.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p.grad is not None:
            grads.append((p.grad, p_hi.grad, p_ref.grad))
            if low == torch.float32:
                assert_close_tolerance(p.grad, p_hi.grad, p_ref.grad, name=name)
    assert len(grads) >= 10
    if low != torch.float32:
        a, h, r = (torch.cat([g[i].double().flatten() for g in grads]) for i in range(3))
        err, base = (a - h).norm().item(), (r - h).norm().item()
        assert err <= 2 * base + 0.02 * h.norm().item(), f"gradients: |a - hi| = {err:.4g}, |ref - hi| = {base:.4g}"


def check_generate(mod, ref, device="cpu", unpadded=True):
    ids = torch.randint(3, V, (3, 7), device=device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    mod.eval()
    ref.eval()
    for m in (mask, torch.ones_like(mask))[:2 if unpadded else 1]:
        want = ref.generate(ids, attention_mask=m, max_new_tokens=5, do_sample=False)
        got = mod.generate(ids, attention_mask=m, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------ per family


@pytest.mark.parametrize("family", FAMILIES)
def test_family_training_generate_and_report(family):
    mod, ref, hi, report = models(family)
    want = dict.fromkeys(KINDS, 0)
    want.update(EXPECTED[family], cross_entropy=1, attention=2)
    assert report.counts == want, str(report)
    assert report.unrecognized == {} and report.notes == [], str(report)
    assert mod.config._attn_implementation == "culmen"
    assert [k for k, _ in mod.state_dict().items()] == [k for k, _ in ref.state_dict().items()]
    check_training(mod, ref, hi)
    check_generate(mod, ref)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gpt_neox"])
def test_kernels_under_the_interpreter(triton_backend, family):
    """RMSNorm / LayerNorm, full and partial rotary, SwiGLU (separate and packed gate/up), GELU, attention
    (varlen, KV cache) and fused linear + CE through culmen's Triton kernels (TRITON_INTERPRET on CPU)."""
    mod, ref, hi, _ = models(family)
    check_training(mod, ref, hi)
    if family == "qwen3":  # the decoding kernels once, left-padded (each interpreted launch is slow)
        check_generate(mod, ref, unpadded=False)


# ------------------------------------------------------------------------------------- patch mechanics


def test_patch_is_idempotent_and_keeps_parameters():
    mod, ref, _, first = models("gemma2")
    params = list(mod.parameters())
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        before = mod(ids, attention_mask=mask).logits
    again = culmen_hf.patch(mod)
    assert again.total == 0
    assert {k: v for k, v in again.already_patched.items() if v} == {k: v for k, v in first.counts.items() if v}
    assert all(a is b for a, b in zip(params, mod.parameters()))
    with torch.no_grad():
        assert torch.equal(mod(ids, attention_mask=mask).logits, before)
    assert "rms_norm=9" in str(first) and "already patched" in str(again)


def test_other_models_of_the_class_are_untouched():
    ref = AutoModelForCausalLM.from_config(config("llama"), attn_implementation="eager")
    other = copy.deepcopy(ref)
    ids = torch.randint(3, V, (2, 6))
    with torch.no_grad():
        before = other(ids).logits
    culmen_hf.patch(ref)
    attn = other.model.layers[0].self_attn
    assert type(attn) is transformers.models.llama.modeling_llama.LlamaAttention
    llama = transformers.models.llama.modeling_llama
    assert llama.apply_rotary_pos_emb.__module__ == llama.__name__  # the module's function is not replaced
    with torch.no_grad():
        assert torch.equal(other(ids).logits, before)
    assert type(ref.model.layers[0].self_attn).__name__ == "LlamaAttention"  # same name, culmen's forward
    assert type(ref.model.layers[0].self_attn) is not type(attn)
    assert isinstance(ref.model.layers[0].self_attn, type(attn))


def test_flags_select_kinds():
    ref = AutoModelForCausalLM.from_config(config("phi3"), attn_implementation="eager")
    mod = copy.deepcopy(ref)
    off = dict(rms_norm=False, layer_norm=False, rotary=False, mlp=False, cross_entropy=False, attention=False)
    report = culmen_hf.patch(mod, **off)
    assert report.total == 0 and report.unrecognized == {}
    ids = torch.randint(3, V, (2, 6))
    with torch.no_grad():
        assert torch.equal(mod(ids).logits, ref(ids).logits)
    report = culmen_hf.patch(mod, **{**off, "mlp": True})
    assert report.counts["mlp"] == 2 and report.total == 2
    report = culmen_hf.patch(mod, rms_norm=True, rotary=False, mlp=True, cross_entropy=False, attention=False)
    assert report.counts["rms_norm"] == 5 and report.already_patched["mlp"] == 2 and report.total == 5


class _OddNorm(torch.nn.Module):
    """RMSNorm-shaped (weight, eps) but not an RMSNorm: patch must leave it alone."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.variance_epsilon)


def test_unknown_modules_are_left_alone_and_reported():
    ref = AutoModelForCausalLM.from_config(config("llama"), attn_implementation="eager")
    ref.model.layers[0].post_attention_layernorm = _OddNorm(32)
    ref.model.layers[1].mlp.act_fn = transformers.activations.QuickGELUActivation()
    hi = copy.deepcopy(ref).double()
    hi.set_attn_implementation("culmen_patch_oracle")
    mod = copy.deepcopy(ref)
    report = culmen_hf.patch(mod)
    assert report.unrecognized == {"_OddNorm": 1, "QuickGELUActivation": 1}, str(report)
    assert report.counts["rms_norm"] == 4 and report.counts["mlp"] == 1
    assert any("post_attention_layernorm" in n for n in report.notes)
    assert any("layers.1.mlp" in n for n in report.notes)
    assert type(mod.model.layers[0].post_attention_layernorm) is _OddNorm
    check_training(mod, ref, hi)


def test_instance_level_forwards_are_left_alone():
    """accelerate's offload hooks set ``module.forward`` on the instance, which a class swap cannot override."""
    mod = AutoModelForCausalLM.from_config(config("llama"), attn_implementation="eager")
    norm = mod.model.norm
    norm.forward = norm.forward
    report = culmen_hf.patch(mod)
    assert report.counts["rms_norm"] == 4 and type(norm) is transformers.models.llama.modeling_llama.LlamaRMSNorm
    assert any(n.startswith("model.norm:") for n in report.notes)


def test_loss_conventions():
    """num_items_in_batch (sum / count), shift_labels, eval mode (logits kept), tuple outputs."""
    mod, ref, _, _ = models("gemma3")
    ids, mask, labels = padded_batch()
    mod.train()
    ref.train()
    n = torch.tensor(11)
    kw = dict(attention_mask=mask, labels=labels, num_items_in_batch=n)
    torch.testing.assert_close(mod(ids, **kw).loss, ref(ids, **kw).loss)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shift[:, ::2] = -100  # differs from what the model would derive from labels
    kw = dict(attention_mask=mask, labels=labels, shift_labels=shift)  # shift_labels replace the shifted labels
    torch.testing.assert_close(mod(ids, **kw).loss, ref(ids, **kw).loss)
    assert mod(ids, attention_mask=mask, shift_labels=shift).loss is None  # as transformers: no labels, no loss
    out = mod(ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0
    torch.testing.assert_close(out[0], ref(ids, attention_mask=mask, labels=labels).loss)
    mod.eval()
    ref.eval()
    a, b = mod(ids, attention_mask=mask, labels=labels), ref(ids, attention_mask=mask, labels=labels)
    assert a.logits is not None
    torch.testing.assert_close(a.loss, b.loss)
    assert "labels" in inspect.signature(mod.forward).parameters  # generate() reads the signature


def test_rotary_function_against_float64():
    B, h, hk, S, D = 3, 4, 2, 7, 12
    for rd, rows in ((12, B), (12, 1), (6, B)):
        q = torch.randn(B, S, h, D).transpose(1, 2).requires_grad_()
        k = torch.randn(B, S, hk, D).transpose(1, 2).requires_grad_()
        ang = torch.randn(rows, S, rd // 2) * 3
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        got = culmen_apply_rotary_pos_emb(q, k, cos, sin)
        g = [torch.randn_like(t) for t in got]
        dgot = torch.autograd.grad(got, (q, k), g)
        refs = {}
        for dt in (torch.float64, torch.float32):
            qq, kk = q.detach().to(dt).requires_grad_(), k.detach().to(dt).requires_grad_()
            c, s = cos.to(dt)[:, None], sin.to(dt)[:, None]

            def rot(x, c=c, s=s, rd=rd):
                xr, xp = x[..., :rd], x[..., rd:]
                half = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
                return torch.cat([xr * c + half * s, xp], -1)

            outs = (rot(qq), rot(kk))
            refs[dt] = (*outs, *torch.autograd.grad(outs, (qq, kk), [t.to(dt) for t in g]))
        for name, a, hi_, lo in zip(("q", "k", "dq", "dk"), (*got, *dgot), refs[torch.float64], refs[torch.float32]):
            assert_close_tolerance(a, hi_, lo, name=f"{name} rd={rd} rows={rows}")
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        culmen_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    # The drop-in hands other call forms (an older ``position_ids`` argument in that place) to the original.
    from culmen.integrations.hf_patch import _rotary_for

    seen = []
    drop_in = _rotary_for(lambda *a, **kw: seen.append((a, kw)) or "original")
    assert drop_in(q, k, cos, sin, torch.arange(S)) == "original" and len(seen[0][0]) == 5


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        culmen_hf.patch("not a model")
    with pytest.raises(ValueError, match="activation"):
        CulmenActivation("swish2")
    act = CulmenActivation("gelu_tanh")
    x = torch.randn(5, 7)
    torch.testing.assert_close(act(x), torch.nn.functional.gelu(x, approximate="tanh"))


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "gpt_neox"])
def test_gpu_bf16_training(family):
    # OPT is checked in fp32 only: its ReLU MLPs make bf16 gradients flip between equally valid models.
    mod, ref, hi, _ = models(family, torch.bfloat16, "cuda", hi_dtype=torch.float32)
    check_training(mod, ref, hi, "cuda")


def check_static_generate(mod, ref, device, **compile_kw):
    ids = torch.randint(3, V, (3, 7), device=device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    mod.eval()
    ref.eval()
    want = ref.generate(ids, attention_mask=mask, disable_compile=True, **kw)
    assert torch.equal(mod.generate(ids, attention_mask=mask, **kw, **compile_kw), want)


def test_compiled_static_cache_generate():
    """transformers compiles StaticCache decoding (fullgraph) on GPUs; every patched piece must trace.
    Forced here on CPU with dynamo's eager backend."""
    cc = transformers.CompileConfig(backend="eager", fullgraph=True)
    if not hasattr(cc, "_compile_all_devices"):
        pytest.skip("this transformers cannot compile generate on CPU")
    cc._compile_all_devices = True
    mod, ref, _, _ = models("gemma3")
    torch._dynamo.reset()
    check_static_generate(mod, ref, "cpu", compile_config=cc)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_training_step(family):
    """A patched model traces whole (fullgraph) for training: loss and gradients as eager."""
    mod, ref, _, _ = models(family)
    ids, _, _ = padded_batch()
    torch._dynamo.reset()
    compiled = torch.compile(mod.train(), backend="eager", fullgraph=True)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    want = ref.train()(ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss, want)
    for (n, p), q in zip(mod.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_fp32_generate_dynamic_and_static_cache(family):
    mod, ref, _, _ = models(family, torch.float32, "cuda")
    check_generate(mod, ref, "cuda")
    check_static_generate(mod, ref, "cuda", disable_compile=True)


@pytest.mark.gpu
def test_gpu_static_cache_generate_auto_compiled():
    """On CUDA, generate compiles StaticCache decoding (inductor, CUDA graphs) by default."""
    mod, ref, _, _ = models("llama", torch.float32, "cuda")
    torch._dynamo.reset()
    check_static_generate(mod, ref, "cuda")
