"""``culmen.flash_attn.models.bert`` against Hugging Face ``transformers``' BERT on the same weights.

A tiny random ``transformers`` ``BertForPreTraining`` is the source: its ``state_dict`` goes through
``remap_state_dict`` into culmen's model. The oracle is the HF model in float64, the baseline the HF
model in the test dtype (tolerance rule). Checked: sequence / pooled outputs, MLM and NSP logits, the
loss and the gradient of every parameter (HF's gradients mapped by the same remap), on padded batches
with the padded (``use_flash_attn=False``) and the unpadded varlen path, ``dense_seq_output`` /
``last_layer_subset``, the fused flags, the vocab padding; and the remap round trips bit-exact.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.bert.modeling_bert import BertForPreTraining as HFBertForPreTraining  # noqa: E402

from culmen.flash_attn.models.bert import (  # noqa: E402
    BertForPreTraining,
    BertModel,
    inv_remap_state_dict,
    remap_state_dict,
)
from culmen.testing import assert_close_tolerance  # noqa: E402
from culmen.testing.tolerance import default_atol  # noqa: E402

F32, F64 = torch.float32, torch.float64
VOCAB = 53


def _config(**extra) -> transformers.BertConfig:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=40, max_position_embeddings=24, type_vocab_size=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    cfg._attn_implementation = "eager"
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def _hf_model(cfg, seed: int = 0, device="cpu") -> HFBertForPreTraining:
    torch.manual_seed(seed)
    model = HFBertForPreTraining(cfg)
    with torch.no_grad():
        # O(1) activations (the init's std 0.02 makes outputs tiny and insensitive) and non-default
        # norms and biases, so a swapped or dropped piece changes the outputs.
        for name, p in model.named_parameters():
            if "embeddings" in name:
                p.normal_()
            elif name.endswith("weight") and p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(device).eval()


def _culmen_model(cfg, hf, dtype=F32, cls=BertForPreTraining):
    model = cls(cfg)
    sd = remap_state_dict(hf.state_dict(), cfg)
    if cls is BertModel:
        sd = {k[len("bert."):]: v for k, v in sd.items() if k.startswith("bert.")}
    model.load_state_dict(sd, strict=True)
    return model.to(device=next(hf.parameters()).device, dtype=dtype).eval()


def _batch(batch=3, seqlen=11, lengths=(11, 7, 4), device="cpu", masked_frac=0.4, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(1, VOCAB, (batch, seqlen), generator=g)
    types = torch.randint(0, 2, (batch, seqlen), generator=g)
    labels = torch.randint(1, VOCAB, (batch, seqlen), generator=g)
    labels[(torch.rand(batch, seqlen, generator=g) > masked_frac) | ~mask] = 0
    labels[0, 2] = 5  # at least one masked token
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return {k: v.to(device) for k, v in dict(input_ids=ids, token_type_ids=types, attention_mask=mask,
                                               labels=labels, next_sentence_label=nsp).items()}


def _hf_labels(b):
    """flash_attn's MLM labels ignore 0; Hugging Face's ignore -100."""
    return {**b, "labels": torch.where(b["labels"] == 0, -100, b["labels"])}


def _hf_refs(hf, dtype, inputs, objective):
    """Run ``objective`` on float64 and ``dtype`` copies of ``hf``; return (outputs, grads by HF name)."""
    out = []
    for ref_dtype in (F64, dtype):
        m = _copy(hf).to(ref_dtype)
        res = objective(m, inputs)
        res[0].backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        out.append(([r.detach() for r in res], grads))
    return out


def _copy(model):
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    return clone.to(next(model.parameters()).device).eval()


def _compare_grads(model, hf_grads_hi, hf_grads_lo, cfg, label):
    hi = remap_state_dict(hf_grads_hi, cfg)
    lo = remap_state_dict(hf_grads_lo, cfg)
    checked = 0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{label}: no gradient for {name}"
        # flash_attn's rule for gradients (3x the low-precision error): a parameter's gradient here sums the
        # rounding of every kernel after it, and at 2x the fp16 case failed by 0.01% of its budget when the
        # attention backward changed only its accumulation order (H200, 2026-11-27).
        assert_close_tolerance(p.grad, hi[name], lo[name], factor=3.0, name=f"{label} d{name}")
        checked += 1
    assert checked == len(list(model.parameters()))


def _pretraining_objective(valid, dense_idx=None):
    """Loss + random projections of the logits (so every output carries gradient)."""
    def run(model, b, hf=True):
        kw = _hf_labels(b) if hf else b
        out = model(**kw)
        logits = out.prediction_logits
        if hf:
            logits = logits[valid] if dense_idx is None else logits.reshape(-1, logits.shape[-1])[dense_idx]
        elif dense_idx is None:
            logits = logits[valid]
        gen = torch.Generator().manual_seed(5)
        g1 = torch.randn(logits.shape, generator=gen).to(logits)
        g2 = torch.randn(out.seq_relationship_logits.shape, generator=gen).to(logits)
        loss = out.loss
        if hf:
            # transformers rounds its loss to the model dtype (a bf16 scalar near 30 is exact to 0.125 only);
            # culmen's is fp32, as flash_attn's: recompute the reference loss in fp32 from its own logits.
            mlm, nsp = out.prediction_logits.float(), out.seq_relationship_logits.float()
            loss = (torch.nn.functional.cross_entropy(mlm.reshape(-1, mlm.shape[-1]), kw["labels"].reshape(-1))
                    + torch.nn.functional.cross_entropy(nsp, kw["next_sentence_label"].reshape(-1)))
            loss = loss.to(out.loss.dtype if out.loss.dtype == torch.float64 else torch.float32)
        # The sums are taken in fp32 (or fp64): a low-precision sum's rounding would dominate the comparison.
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        total = (loss.to(acc) + (logits.to(acc) * g1.to(acc)).sum() * 0.1
                 + (out.seq_relationship_logits.to(acc) * g2.to(acc)).sum())
        return total, loss, logits, out.seq_relationship_logits
    return run


def _check_pretraining(cfg, hf, b, dtype=F32, dense=False, label=""):
    valid = b["attention_mask"].bool() if b["attention_mask"] is not None else None
    dense_idx = torch.nonzero(b["labels"].flatten() > 0).flatten() if dense else None
    objective = _pretraining_objective(valid, dense_idx)
    model = _culmen_model(cfg, hf, dtype)
    got = objective(model, b, hf=False)
    got[0].backward()
    (ref_hi, g_hi), (ref_lo, g_lo) = _hf_refs(hf, dtype, b, objective)
    for name, a, rh, rl in zip(("objective", "loss", "mlm logits", "nsp logits"), got, ref_hi, ref_lo):
        assert torch.isfinite(a).all(), f"{label} {name}"
        if name == "objective":
            continue  # a random projection that only drives the backward: its parts are compared instead
        # The scalar loss of a 16-bit model is judged at the model dtype's resolution: one lucky rounding
        # of the reference's few terms must not set a bound finer than the logits it is computed from.
        atol = default_atol(dtype) * max(1.0, float(rh.abs())) if name == "loss" and dtype != F32 else None
        assert_close_tolerance(a.detach(), rh, rl, atol=atol, name=f"{label} {name}")
    _compare_grads(model, g_hi, g_lo, cfg, label)
    return model


# ---------------------------------------------------------------------------------- remapping


@pytest.mark.parametrize("last_layer_subset", [False, True])
def test_remap_keys_shapes_and_round_trip(last_layer_subset):
    cfg = _config(last_layer_subset=last_layer_subset, dense_seq_output=True)
    hf = _hf_model(cfg)
    hf_sd = hf.state_dict()
    ours = BertForPreTraining(cfg).state_dict()
    mapped = remap_state_dict(hf_sd, cfg)
    assert set(mapped) == set(ours)
    for k, v in ours.items():
        assert mapped[k].shape == v.shape, k
    last = "bert.encoder.layers.1.mixer."
    assert (f"{last}Wq.weight" in mapped) == last_layer_subset and (f"{last}Wqkv.weight" in mapped) != last_layer_subset
    w = hf_sd["bert.encoder.layer.0.attention.self.key.weight"]
    assert torch.equal(mapped["bert.encoder.layers.0.mixer.Wqkv.weight"][32:64], w)
    assert torch.equal(mapped["cls.predictions.decoder.bias"], hf_sd["cls.predictions.bias"])
    # HF -> culmen -> HF is the identity, bit for bit, and loads strictly into transformers.
    back = inv_remap_state_dict(mapped, cfg)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k
    fresh = HFBertForPreTraining(cfg)
    fresh.load_state_dict(back, strict=True)
    # culmen -> HF -> culmen as well, starting from culmen's own (randomly initialized) weights.
    again = remap_state_dict(inv_remap_state_dict(ours, cfg), cfg)
    assert set(again) == set(ours) and all(torch.equal(again[k], v) for k, v in ours.items())
    assert set(hf_sd) == set(hf.state_dict())  # inputs untouched


def test_remap_legacy_gamma_beta_names_and_errors():
    cfg = _config()
    sd = _hf_model(cfg).state_dict()
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in sd.items()}
    assert any(k.endswith("gamma") for k in legacy)
    a, b = remap_state_dict(sd, cfg), remap_state_dict(legacy, cfg)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    del legacy["bert.encoder.layer.1.attention.self.value.bias"]
    with pytest.raises(ValueError, match="attention.self.value.bias"):
        remap_state_dict(legacy, cfg)


def test_pad_vocab_size_multiple():
    cfg = _config(pad_vocab_size_multiple=8)
    hf = _hf_model(_config())
    model = BertForPreTraining(cfg)
    assert cfg.vocab_size == 56 and model.bert.embeddings.word_embeddings.weight.shape == (56, 32)
    mapped = remap_state_dict(hf.state_dict(), cfg)
    assert mapped["cls.predictions.decoder.bias"][VOCAB:].eq(-100).all()
    assert mapped["bert.embeddings.word_embeddings.weight"][VOCAB:].eq(0).all()
    model.load_state_dict(mapped)
    model.eval()
    b = _batch()
    with torch.no_grad():
        ours = model(b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
        ref = hf(b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"])
    valid = b["attention_mask"]
    torch.testing.assert_close(ours.prediction_logits[valid][:, :VOCAB], ref.prediction_logits[valid])
    assert (ours.prediction_logits[..., VOCAB:] < -50).all()
    with pytest.raises(ValueError, match="orig_vocab_size"):
        inv_remap_state_dict(mapped, cfg)
    cfg.orig_vocab_size = VOCAB
    back = inv_remap_state_dict(mapped, cfg)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())


def test_from_pretrained_local_checkpoint(tmp_path):
    cfg = _config()
    hf = _hf_model(cfg)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model = BertForPreTraining.from_pretrained(str(tmp_path), cfg)
    mapped = remap_state_dict(hf.state_dict(), cfg)
    assert all(torch.equal(v, mapped[k]) for k, v in model.state_dict().items())
    encoder_only = BertModel.from_pretrained(str(tmp_path), cfg)
    assert torch.equal(encoder_only.pooler.dense.weight, hf.bert.pooler.dense.weight)


# ---------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("use_flash_attn", [False, True])
def test_bert_model_matches_hf(use_flash_attn):
    cfg = _config(use_flash_attn=use_flash_attn)
    hf = _hf_model(cfg)
    model = _culmen_model(cfg, hf, cls=BertModel)
    b = _batch()
    valid = b["attention_mask"]
    kw = dict(token_type_ids=b["token_type_ids"], attention_mask=valid)
    out = model(b["input_ids"], **kw)
    assert out.last_hidden_state.shape == (3, 11, 32) and out.pooler_output.shape == (3, 32)
    if use_flash_attn:  # the unpadded path scatters zeros into the padded rows
        assert out.last_hidden_state[~valid].eq(0).all()
    with torch.no_grad():
        refs = [_copy(hf).to(dt).bert(b["input_ids"], **kw) for dt in (F64, F32)]
        assert_close_tolerance(out.last_hidden_state[valid], refs[0].last_hidden_state[valid],
                               refs[1].last_hidden_state[valid], name="sequence output")
        assert_close_tolerance(out.pooler_output, refs[0].pooler_output, refs[1].pooler_output, name="pooled")


@pytest.mark.parametrize("use_flash_attn", [False, True])
def test_pretraining_matches_hf(use_flash_attn):
    cfg = _config(use_flash_attn=use_flash_attn)
    b = _batch()
    b["attention_mask"] = b["attention_mask"].long()  # an integer mask: the model takes it as bool
    _check_pretraining(cfg, _hf_model(cfg), b, label=f"flash={use_flash_attn}")


@pytest.mark.parametrize("use_flash_attn,last_layer_subset,padded", [
    (True, True, True),
    (True, False, True),
    (False, True, True),
    (True, True, False),
])
def test_dense_seq_output_and_last_layer_subset(use_flash_attn, last_layer_subset, padded):
    cfg = _config(use_flash_attn=use_flash_attn, dense_seq_output=True, last_layer_subset=last_layer_subset)
    b = _batch(lengths=(11, 7, 4) if padded else (11, 11, 11))
    if not padded:
        b["attention_mask"] = None
    hf = _hf_model(cfg)
    model = _check_pretraining(cfg, hf, b, dense=True,
                               label=f"dense flash={use_flash_attn} subset={last_layer_subset} padded={padded}")
    with torch.no_grad():
        out = model(**b)
    assert out.prediction_logits.shape == (int((b["labels"] > 0).sum()), VOCAB)


def test_fused_flags_and_xentropy_match_hf():
    cfg = _config(hidden_act="gelu_new", use_flash_attn=True, fused_bias_fc=True, fused_mlp=True,
                  mlp_checkpoint_lvl=[0, 1], fused_dropout_add_ln=True)
    hf = _hf_model(cfg)
    _check_pretraining(cfg, hf, _batch(), label="fused")
    # culmen's CrossEntropyLoss for both losses: same loss and gradients as HF's.
    cfg_x = _config(use_xentropy=True, dense_seq_output=True, last_layer_subset=True, use_flash_attn=True)
    hf = _hf_model(cfg_x)
    model = _culmen_model(cfg_x, hf)
    assert type(model.mlm_loss).__module__ == "culmen.flash_attn.losses.cross_entropy"
    b = _batch()
    loss = model(**b).loss
    loss.backward()
    refs = []
    for dt in (F64, F32):
        m = _copy(hf).to(dt)
        ref = m(**_hf_labels(b)).loss
        ref.backward()
        refs.append((ref.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert_close_tolerance(loss.detach(), refs[0][0], refs[1][0], name="xentropy loss")
    _compare_grads(model, refs[0][1], refs[1][1], cfg_x, "xentropy")


def test_varlen_kernels_under_interpreter(triton_backend):
    """The unpadded path through culmen's Triton attention kernels (the interpreter on CPU)."""
    cfg = _config(use_flash_attn=True, dense_seq_output=True, last_layer_subset=True, num_hidden_layers=1)
    _check_pretraining(cfg, _hf_model(cfg), _batch(lengths=(9, 11, 3)), dense=True, label="triton varlen")


def test_config_errors_and_init():
    cfg = _config()
    with pytest.raises(ValueError, match="BertConfig"):
        BertModel(object())
    with pytest.raises(ValueError, match="hidden_act"):
        BertModel(_config(hidden_act="relu"))
    with pytest.raises(ValueError, match="dense_seq_output"):
        BertForPreTraining(_config(last_layer_subset=True))
    with pytest.raises(ValueError, match="fused_mlp"):
        BertModel(_config(fused_mlp=True))
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    emb = model.bert.embeddings.word_embeddings.weight
    assert emb[0].eq(0).all() and 0.015 < emb[1:].std().item() < 0.025
    assert not model.bert.encoder.layers[0].mixer.Wqkv.bias.any()
    assert model.mlm_loss.ignore_index == 0 and model.nsp_loss.ignore_index == -1
    assert isinstance(model.mlm_loss, torch.nn.CrossEntropyLoss)
    assert BertModel(cfg, add_pooling_layer=False).pooler is None


def test_runs_without_transformers(monkeypatch):
    """Without ``transformers`` the module takes any config with BertConfig's fields and returns
    stand-in output records: same numbers as with it."""
    import importlib.util
    import sys
    from types import SimpleNamespace

    import culmen.flash_attn.models.bert as with_hf

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    spec = importlib.util.spec_from_file_location("_bert_without_hf", with_hf.__file__)
    bare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bare)
    assert bare.BertConfig is None
    cfg = _config(use_flash_attn=True)
    hf = _hf_model(cfg)
    plain_cfg = SimpleNamespace(**{k: getattr(cfg, k) for k in bare._CONFIG_FIELDS}, use_flash_attn=True)
    model = bare.BertForPreTraining(plain_cfg)
    model.load_state_dict(bare.remap_state_dict(hf.state_dict(), plain_cfg))
    ref = _culmen_model(cfg, hf)
    b = _batch()
    with torch.no_grad():
        out, want = model.eval()(**b), ref(**b)
    assert torch.equal(out.prediction_logits, want.prediction_logits) and torch.equal(out.loss, want.loss)
    assert out[1] is out.prediction_logits and out["loss"] is out.loss
    with pytest.raises(ValueError, match="hidden_size"):
        bare.BertModel(SimpleNamespace(vocab_size=3))


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused,subset", [(False, False), (True, True)])
def test_pretraining_gpu_low_precision(dtype, fused, subset):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=200, max_position_embeddings=80, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0,
                                  hidden_act="gelu_new" if fused else "gelu")
    cfg._attn_implementation = "eager"
    cfg.use_flash_attn = True
    cfg.dense_seq_output = subset
    cfg.last_layer_subset = subset
    if fused:
        cfg.fused_bias_fc = cfg.fused_mlp = cfg.fused_dropout_add_ln = True
    hf = _hf_model(cfg, device="cuda")
    b = _batch(batch=4, seqlen=67, lengths=(67, 40, 9, 51), device="cuda")
    _check_pretraining(cfg, hf, {k: v for k, v in b.items()}, dtype=dtype, dense=subset,
                       label=f"gpu {dtype} fused={fused} subset={subset}")
