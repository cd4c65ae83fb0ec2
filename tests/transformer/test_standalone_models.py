"""``culmen.transformer.testing``: Apex's standalone GPT and BERT on spawned gloo ranks.

Tiny models (2 layers, hidden 32, 4 heads, vocab 64, sequence 16), float64 parameters, dropout off:

* the one-rank GPT equals a plain-PyTorch GPT written here from the state dict (per-token loss and the
  gradient of every parameter);
* GPT with tensor parallelism 2 (plain, sequence-parallel, full/selective recompute) equals the one-rank
  model loaded with the same weights: per-token losses, and every gradient after gathering the shards
  (and summing the sequence-parallel partial gradients over the TP group);
* BERT (padding mask, token types, binary head) with TP=2, with and without sequence parallelism,
  equals the one-rank BERT (LM loss, binary logits, every gradient);
* ``commons.ToyParallelMLP`` through its step function (TP=2, with and without sequence parallelism)
  equals TP=1; ``MyModel`` / ``fwd_step_func`` / ``IdentityLayer`` behave as Apex's tests expect;
* a 2-stage 1F1B pipeline GPT (``get_forward_backward_func``) equals one process running the whole
  model on the same microbatches (losses, every gradient; the tied word embeddings' two copies are
  all-reduced as a training loop must);
* in-process: argument parsing and the global-variable guards.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
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
    args.use_cpu_initialization = True  # CPU tensors for gloo even on a host with GPUs
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


def _commons_cases(failures):
    """``commons``: ToyParallelMLP (TP=2, with and without sequence parallelism) through its step function
    equals TP=1; MyModel's step function and input routing."""
    import torch.distributed as dist

    from culmen.transformer import parallel_state as ps
    from culmen.transformer.testing import commons

    x = torch.randn(B, S, H, dtype=F64, generator=torch.Generator().manual_seed(3))
    _init_parallel(1)
    mlp = commons.mlp_provider_func(H, True, True).double().cpu()
    out, loss_func = commons.ToyParallelMLPFwdBwdStepFunc(False)([x], mlp)
    loss_func(out)[0].backward()
    ref_out, ref_sd = out.detach(), {k: v.detach().clone() for k, v in mlp.named_parameters()}
    ref_grads = {k: v.grad.clone() for k, v in mlp.named_parameters()}
    for sp in (False, True):
        _init_parallel(2)
        model = commons.mlp_provider_func(H, True, True, sequence_parallel_enabled=sp).double().cpu()
        _load_shards(model, ref_sd)
        out, loss_func = commons.ToyParallelMLPFwdBwdStepFunc(sp)([x], model)
        loss_func(out)[0].backward()  # with sp each rank sums its own tokens: the partial losses add up
        if sp:
            parts = [torch.empty_like(out) for _ in range(2)]
            dist.all_gather(parts, out.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
            out = torch.cat(parts)
        _check(failures, f"ToyParallelMLP sp={sp} output", out, ref_out)
        grads = _full_grads(model)
        for name, g in ref_grads.items():
            _check(failures, f"ToyParallelMLP sp={sp} grad {name}", grads[name], g)

    model = commons.model_provider_func(H, True, True).double().cpu()
    out, loss_func = commons.fwd_step_func([x], model)
    loss, reduced = loss_func(out)
    _check(failures, "MyModel loss", loss, out.sum())
    _check(failures, "MyModel averaged loss", reduced["avg"].reshape(()), loss)
    received = torch.randn(S, B, H, dtype=F64)
    model.set_input_tensor(received)
    _check(failures, "MyModel received input", model(None), model.layer(received))
    layer = commons.IdentityLayer((3, 5), scale=2.0)
    if layer().shape != (3, 5) or layer() is not layer.weight:
        failures.append("IdentityLayer does not return its weight")


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
        _commons_cases(failures)
        if get_args().padded_vocab_size != VOCAB:
            failures.append("arguments changed by the runs")
    except Exception:
        failures.append(traceback.format_exc())
    return failures


def test_gpt_and_bert_tensor_parallel_equal_one_rank():
    results = run_group(_tp_worker, 2, timeout=110)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}:\n" + "\n".join(failures)


# ------------------------------------------------------------------------------ pipeline parallelism

M = 4  # microbatches


def _pp_forward_step(batch, model):
    tokens, labels = batch
    per_token = _gpt_loss(model, tokens, labels)

    def loss_func(out):
        loss = out.mean()
        return loss, {"loss": loss.detach()}

    return per_token, loss_func


def _pp_worker(rank, world):
    import torch.distributed as dist

    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import build_model, get_forward_backward_func
    from culmen.transformer.pipeline_parallel import utils as pp_utils
    from culmen.transformer.testing.standalone_gpt import GPTModel, gpt_model_provider

    failures = []
    try:
        _setup_args()
        tokens, labels = _data(11, b=M * B)

        # The whole model in one process on the same microbatches: gradient of the mean microbatch loss.
        _init_parallel(1)
        ref = GPTModel()
        ref_losses = []
        for k in range(M):
            loss = _gpt_loss(ref, tokens[k * B:(k + 1) * B], labels[k * B:(k + 1) * B]).mean()
            (loss / M).backward()
            ref_losses.append(loss.detach())
        ref_sd = {k: v.detach().clone() for k, v in ref.named_parameters()}
        ref_grads = {k: v.grad.clone() for k, v in ref.named_parameters()}

        _init_parallel(1, 2)
        pp_utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
        pp_utils.setup_microbatch_calculator(rank, None, M * B, B, 1)
        (model,) = build_model(gpt_model_provider, wrap_with_ddp=False)
        stage = ps.get_pipeline_model_parallel_rank()
        per_stage = LAYERS // 2

        def to_ref_name(name: str) -> str:
            # Stage-local layer i is global layer i + stage * per_stage; the last stage's copy of the
            # word embeddings is the input embedding.
            if name == "word_embeddings.weight":
                return "language_model.embedding.word_embeddings.weight"
            prefix = "language_model.encoder.layers."
            if name.startswith(prefix):
                i, rest = name[len(prefix):].split(".", 1)
                return f"{prefix}{int(i) + stage * per_stage}.{rest}"
            return name

        shared = model.word_embeddings_weight()
        if stage == 1:
            # initialize_word_embeddings must have copied stage 0's embedding into the zeroed copy.
            first = ref_sd["language_model.embedding.word_embeddings.weight"].clone()
            got = shared.detach().clone()
            dist.broadcast(first, src=0, group=ps.get_embedding_group())
            if not torch.equal(got, first):
                failures.append("last stage's word embeddings differ from the first stage's after init")
        else:
            dist.broadcast(shared.detach().clone(), src=0, group=ps.get_embedding_group())
        _load_shards(model, ref_sd, to_ref_name)

        fwd_bwd = get_forward_backward_func(None, 2)
        losses = fwd_bwd(_pp_forward_step, [tokens, labels], model, forward_only=False, tensor_shape=(S, B, H),
                         dtype=F64)
        # The two copies of the tied word embeddings train as one parameter.
        dist.all_reduce(model.word_embeddings_weight().grad, group=ps.get_embedding_group())
        grads = _full_grads(model, to_ref_name)
        expected_names = {to_ref_name(n) for n, _ in model.named_parameters()}
        if stage == 1:
            if len(losses) != M:
                failures.append(f"last stage returned {len(losses)} losses, expected {M}")
            for k, (got, want) in enumerate(zip(losses, ref_losses)):
                _check(failures, f"pp microbatch {k} loss", got["loss"], want)
            if "language_model.encoder.final_layernorm.weight" not in expected_names:
                failures.append("last stage has no final layer norm")
        elif losses:
            failures.append(f"first stage returned losses: {losses}")
        for name in expected_names:
            _check(failures, f"pp stage {stage} grad {name}", grads[name], ref_grads[name])
        # Every reference parameter lives on some stage.
        names = [None, None]
        dist.all_gather_object(names, sorted(expected_names))
        missing = set(ref_grads) - set(names[0]) - set(names[1])
        if missing:
            failures.append(f"parameters on no stage: {sorted(missing)}")
    except Exception:
        failures.append(traceback.format_exc())
    return failures


def test_gpt_two_stage_1f1b_equals_one_process():
    results = run_group(_pp_worker, 2, timeout=110)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}:\n" + "\n".join(failures)


# ------------------------------------------------------------------------------ in-process


def test_parse_args_derives_megatron_settings_and_rejects_bad_sizes(capsys):
    from culmen.transformer.testing.arguments import parse_args

    args = parse_args(defaults=dict(MODEL_ARGS), args=["--bf16", "--sequence-parallel"])
    assert (args.kv_channels, args.ffn_hidden_size, args.global_batch_size) == (H // HEADS, 4 * H, B)
    assert args.params_dtype == torch.bfloat16 and args.accumulate_allreduce_grads_in_fp32
    assert args.gradient_accumulation_fusion and not args.async_tensor_model_parallel_allreduce
    assert args.apply_query_key_layer_scaling and args.bert_binary_head and args.masked_softmax_fusion
    plain = parse_args(defaults=dict(MODEL_ARGS), args=["--checkpoint-activations"])
    assert plain.params_dtype == torch.float32 and not plain.gradient_accumulation_fusion
    assert plain.async_tensor_model_parallel_allreduce
    assert (plain.recompute_granularity, plain.recompute_method) == ("full", "uniform")
    off = parse_args(defaults=dict(MODEL_ARGS), args=["--no-async-tensor-model-parallel-allreduce"])
    assert not off.async_tensor_model_parallel_allreduce
    # A command-line value wins over a default.
    assert parse_args(defaults=dict(MODEL_ARGS), args=["--hidden-size", "64"]).hidden_size == 64

    bad = [
        (["--fp16", "--bf16"], "fp16"),
        (["--batch-size", "4"], "micro-batch-size"),
        (["--num-attention-heads", "5"], "num_attention_heads (5)"),
        (["--seq-length", "32"], "max_position_embeddings (16) < seq_length (32)"),
    ]
    for argv, words in bad:
        defaults = {k: v for k, v in MODEL_ARGS.items() if f"--{k.replace('_', '-')}" not in argv}
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_args(defaults=defaults, args=argv)
    with pytest.raises(ValueError, match="num_layers argument is None"):
        parse_args(defaults={k: v for k, v in MODEL_ARGS.items() if k != "num_layers"}, args=[])
    capsys.readouterr()


def test_global_vars_guard_and_reset(capsys):
    from culmen.transformer.testing import global_vars as gv

    gv.destroy_global_vars()
    with pytest.raises(RuntimeError, match="args is not initialized"):
        gv.get_args()
    with pytest.raises(AssertionError, match="timers is not initialized"):  # Apex asserted
        gv.get_timers()
    gv.set_global_variables(args_defaults=dict(MODEL_ARGS), args=[], override_args={"seed": 7})
    try:
        assert gv.get_args().seed == 7 and gv.get_tensorboard_writer() is None and gv.get_adlr_autoresume() is None
        with pytest.raises(RuntimeError, match="already initialized"):
            gv.set_global_variables(args_defaults=dict(MODEL_ARGS), args=[])
        gv._build_num_microbatches_calculator(gv.get_args())
        assert gv.get_num_microbatches() == 1 and gv.get_current_global_batch_size() == B
        timer = gv.get_timers()("step")
        timer.start()
        timer.stop()
        assert timer.elapsed() >= 0.0
    finally:
        gv.destroy_global_vars()
    capsys.readouterr()
