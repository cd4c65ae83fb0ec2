"""``culmen.transformer.testing``: Apex's standalone GPT and BERT on spawned gloo ranks.

Tiny models (2 layers, hidden 32, 4 heads, vocab 64, sequence 16), float64 parameters, dropout off:

* the one-rank GPT equals a plain-PyTorch GPT written here from the state dict (per-token loss and the
  gradient of every parameter);
* GPT with tensor parallelism 2 (plain, sequence-parallel, full/selective recompute) equals the one-rank
  model loaded with the same weights: per-token losses, and every gradient after gathering the shards
  (and summing the sequence-parallel partial gradients over the TP group);
* BERT (padding mask, token types, binary head) with TP=2, with and without sequence parallelism,
  equals the one-rank BERT (LM loss, binary logits, every gradient);
* a 2-stage 1F1B pipeline GPT (``get_forward_backward_func``) equals one process running the whole
  model on the same microbatches (losses, every gradient; the tied word embeddings' two copies are
  all-reduced as a training loop must);
* in-process: argument parsing and the global-variable guards.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

F64 = torch.float64
B, S, H, HEADS, VOCAB, LAYERS = 2, 16, 32, 4, 64, 2
MODEL_ARGS = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, max_position_embeddings=S,
                  seq_length=S, micro_batch_size=B)


# ------------------------------------------------------------------------------ helpers (run in the workers)


def _setup_args():
    from culmen.transformer.testing import global_vars as gv

    gv.destroy_global_vars()
    gv.set_global_variables(args_defaults=MODEL_ARGS, ignore_unknown_args=True, args=[])
    args = gv.get_args()
    args.padded_vocab_size = VOCAB
    args.hidden_dropout = args.attention_dropout = 0.0
    args.params_dtype = F64
    return args


def _init_parallel(tp: int, pp: int = 1, seed: int = 1234):
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.testing.commons import set_random_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp)
    set_random_seed(seed)


def _data(seed: int, b: int = B):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, S), generator=g)
    labels = torch.randint(0, VOCAB, (b, S), generator=g)
    return tokens, labels


def _check(failures: list, name: str, actual, ref) -> None:
    from culmen.testing.tolerance import assert_close_tolerance

    try:
        # Float64 throughout except the vocab-parallel cross-entropy, whose statistics culmen keeps in
        # fp32: allow fp32 rounding of the loss (a wrong shard or a missing reduction is ~1e-2 off).
        atol = 2e-6 * max(1.0, ref.detach().abs().max().item())
        assert_close_tolerance(actual.detach(), ref.detach(), None, atol=atol, name=name)
    except AssertionError as e:
        failures.append(str(e).splitlines()[0])


def _load_shards(model, full_sd: dict, name_map=lambda n: n) -> None:
    """Copy this rank's shard of every full (one-rank) parameter into ``model``."""
    from culmen.transformer import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = full_sd[name_map(name)]
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(tp, dim=p.partition_dim)[r]
            p.copy_(full)


def _full_grads(model, name_map=lambda n: n) -> dict:
    """Every gradient as the one-rank model would hold it: TP shards gathered, sequence-parallel partial
    gradients summed over the TP group."""
    import torch.distributed as dist

    from culmen.transformer import parallel_state as ps

    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if tp > 1 and getattr(p, "sequence_parallel_enabled", False):
            dist.all_reduce(g, group=group)
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=group)
            g = torch.cat(parts, dim=p.partition_dim)
        out[name_map(name)] = g
    return out


def _gpt_loss(model, tokens, labels):
    from culmen.transformer.pipeline_parallel.utils import get_ltor_masks_and_position_ids

    mask, _, pos = get_ltor_masks_and_position_ids(tokens, VOCAB, False, False, False)
    return model(tokens, pos, mask, labels)


def _reference_gpt_losses(sd: dict, tokens, labels) -> torch.Tensor:
    """Per-token loss ``[b, s]`` of a pre-LN GPT computed directly from the one-rank state dict."""
    b, s = tokens.shape
    hn = H // HEADS
    x = sd["language_model.embedding.word_embeddings.weight"][tokens] \
        + sd["language_model.embedding.position_embeddings.weight"][torch.arange(s)]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)

    def ln(t, prefix):
        return F.layer_norm(t, (H,), sd[prefix + ".weight"], sd[prefix + ".bias"], 1e-5)

    def lin(t, prefix):
        return t @ sd[prefix + ".weight"].T + sd[prefix + ".bias"]

    for i in range(LAYERS):
        p = f"language_model.encoder.layers.{i}."
        # The fused QKV output is laid out head by head: (heads, [q | k | v], head_dim).
        q, k, v = lin(ln(x, p + "input_layernorm"), p + "self_attention.query_key_value").view(
            b, s, HEADS, 3, hn).unbind(3)
        scores = torch.einsum("bqnd,bknd->bnqk", q, k) / hn ** 0.5
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        ctx = torch.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, H)
        x = x + lin(ctx, p + "self_attention.dense")
        hidden = F.gelu(lin(ln(x, p + "post_attention_layernorm"), p + "mlp.dense_h_to_4h"))
        x = x + lin(hidden, p + "mlp.dense_4h_to_h")
    x = ln(x, "language_model.encoder.final_layernorm")
    logits = x @ sd["language_model.embedding.word_embeddings.weight"].T
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(b, s)


# ------------------------------------------------------------------------------ tensor parallelism


def _gpt_tp_case(failures, label, ref_sd, ref_loss, ref_grads, tokens, labels, **arg_changes):
    from culmen.transformer.testing.global_vars import get_args
    from culmen.transformer.testing.standalone_gpt import GPTModel

    args = get_args()
    saved = {k: getattr(args, k) for k in arg_changes}
    for k, v in arg_changes.items():
        setattr(args, k, v)
    try:
        _init_parallel(2)
        model = GPTModel()
        _load_shards(model, ref_sd)
        loss = _gpt_loss(model, tokens, labels)
        loss.mean().backward()
        _check(failures, f"{label} loss", loss, ref_loss)
        grads = _full_grads(model)
        if set(grads) != set(ref_grads):
            failures.append(f"{label}: parameter names differ: {set(grads) ^ set(ref_grads)}")
        for name in ref_grads:
            if name in grads:
                _check(failures, f"{label} grad {name}", grads[name], ref_grads[name])
    finally:
        for k, v in saved.items():
            setattr(args, k, v)


def _bert_run(model, tokens, labels, types, attn, order):
    lm_loss, binary_logits = model(tokens, attn, tokentype_ids=types, lm_labels=labels)
    loss = (lm_loss * attn).sum() / attn.sum() + F.cross_entropy(binary_logits, order)
    loss.backward()
    return lm_loss, binary_logits


def _tp_worker(rank, world):
    from culmen.transformer.testing.global_vars import get_args
    from culmen.transformer.testing.standalone_bert import bert_model_provider
    from culmen.transformer.testing.standalone_gpt import GPTModel

    failures = []
    try:
        args = _setup_args()
        tokens, labels = _data(7)

        # One rank: the model against the plain-PyTorch GPT, and the reference for the TP runs.
        _init_parallel(1)
        ref = GPTModel()
        ref_loss = _gpt_loss(ref, tokens, labels)
        ref_loss.mean().backward()
        ref_sd = {k: v.detach().clone() for k, v in ref.named_parameters()}
        ref_grads = {k: v.grad.clone() for k, v in ref.named_parameters()}
        leaves = {k: v.clone().requires_grad_(True) for k, v in ref_sd.items()}
        plain = _reference_gpt_losses(leaves, tokens, labels)
        plain_grads = torch.autograd.grad(plain.mean(), list(leaves.values()))
        _check(failures, "tp1 loss vs plain GPT", ref_loss, plain)
        for name, g in zip(leaves, plain_grads):
            _check(failures, f"tp1 grad {name} vs plain GPT", ref_grads[name], g)

        _gpt_tp_case(failures, "tp2", ref_sd, ref_loss, ref_grads, tokens, labels)
        _gpt_tp_case(failures, "tp2 sp", ref_sd, ref_loss, ref_grads, tokens, labels, sequence_parallel=True,
                     async_tensor_model_parallel_allreduce=False)
        _gpt_tp_case(failures, "tp2 full recompute", ref_sd, ref_loss, ref_grads, tokens, labels,
                     recompute_granularity="full", recompute_method="uniform", distribute_saved_activations=True)
        _gpt_tp_case(failures, "tp2 sp selective recompute", ref_sd, ref_loss, ref_grads, tokens, labels,
                     sequence_parallel=True, recompute_granularity="selective")

        # BERT: padding in the second sample, two token types, the sentence-order head.
        types = (torch.arange(S) >= S // 2).long().expand(B, S).contiguous()
        attn = torch.ones(B, S, dtype=F64)
        attn[1, S - 5:] = 0
        order = torch.tensor([0, 1])
        _init_parallel(1)
        bert = bert_model_provider()
        bert_loss, bert_logits = _bert_run(bert, tokens, labels, types, attn, order)
        bert_sd = {k: v.detach().clone() for k, v in bert.named_parameters()}
        bert_grads = {k: v.grad.clone() for k, v in bert.named_parameters()}
        for sp in (False, True):
            args.sequence_parallel = sp
            _init_parallel(2)
            model = bert_model_provider()
            _load_shards(model, bert_sd)
            lm_loss, logits = _bert_run(model, tokens, labels, types, attn, order)
            _check(failures, f"bert tp2 sp={sp} lm loss", lm_loss, bert_loss)
            _check(failures, f"bert tp2 sp={sp} binary logits", logits, bert_logits)
            grads = _full_grads(model)
            for name, g in bert_grads.items():
                _check(failures, f"bert tp2 sp={sp} grad {name}", grads[name], g)
        args.sequence_parallel = False
        if get_args().padded_vocab_size != VOCAB:
            failures.append("arguments changed by the runs")
    except Exception:
        failures.append(traceback.format_exc())
    return failures


def test_gpt_and_bert_tensor_parallel_equal_one_rank():
    results = run_group(_tp_worker, 2, timeout=110)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}:\n" + "\n".join(failures)
