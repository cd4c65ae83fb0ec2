"""``culmen.flash_attn.modules.embedding``: ``GPT2Embeddings`` (positions, none, OPT's ``project_in``) and
``BertEmbeddings`` (token types) against the lookups written out, their gradients, flash_attn's
state_dict keys, and ``VocabParallelEmbedding`` / ``ColumnParallelEmbedding`` without a process group
(the tensor-parallel forms run on two gloo ranks in ``test_modules_parallel.py``)."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn.modules.embedding import (
    BertEmbeddings,
    ColumnParallelEmbedding,
    GPT2Embeddings,
    VocabParallelEmbedding,
)
from culmen.testing import randn

F64 = torch.float64


def test_gpt2_embeddings():
    m = GPT2Embeddings(12, 50, 9, dtype=F64)
    assert set(m.state_dict()) == {"word_embeddings.weight", "position_embeddings.weight"}
    ids = torch.randint(0, 50, (3, 7))
    out = m(ids)
    want = m.word_embeddings.weight[ids] + m.position_embeddings.weight[:7]
    torch.testing.assert_close(out, want)
    pos = torch.randint(0, 9, (3, 7))
    torch.testing.assert_close(m(ids, pos), m.word_embeddings.weight[ids] + m.position_embeddings.weight[pos])
    g = randn(out.shape, F64)
    out.backward(g)
    dw = torch.zeros(50, 12, dtype=F64).index_add_(0, ids.flatten(), g.flatten(0, 1))
    torch.testing.assert_close(m.word_embeddings.weight.grad, dw)
    torch.testing.assert_close(m.position_embeddings.weight.grad[:7], g.sum(0))
    assert m.position_embeddings.weight.grad[7:].abs().sum() == 0


def test_gpt2_embeddings_no_positions_and_project_in():
    m = GPT2Embeddings(12, 50, 0, padding_idx=0)
    assert set(m.state_dict()) == {"word_embeddings.weight"} and m.project_in is None
    ids = torch.tensor([[0, 3, 4]])
    torch.testing.assert_close(m(ids), m.word_embeddings.weight[ids])
    assert m(ids)[0, 0].abs().sum() == 0  # padding_idx row initialised to zero
    p = GPT2Embeddings(12, 50, 9, word_embed_proj_dim=6, dtype=F64)
    assert set(p.state_dict()) == {"word_embeddings.weight", "project_in.weight", "position_embeddings.weight"}
    assert p.word_embeddings.weight.shape == (50, 6) and p.project_in.weight.shape == (12, 6)
    ids = torch.randint(0, 50, (2, 5))
    want = p.word_embeddings.weight[ids] @ p.project_in.weight.t() + p.position_embeddings.weight[:5]
    torch.testing.assert_close(p(ids), want)
    with pytest.raises(ValueError, match="input_ids must be a \\(batch, seqlen\\) tensor"):
        p(ids[0])


def test_bert_embeddings():
    m = BertEmbeddings(10, 40, 8, 2, dtype=F64)
    assert set(m.state_dict()) == {"word_embeddings.weight", "position_embeddings.weight",
                                   "token_type_embeddings.weight"}
    ids = torch.randint(0, 40, (2, 6))
    types = torch.randint(0, 2, (2, 6))
    w, p, t = m.word_embeddings.weight, m.position_embeddings.weight, m.token_type_embeddings.weight
    torch.testing.assert_close(m(ids, token_type_ids=types), w[ids] + p[:6] + t[types])
    torch.testing.assert_close(m(ids), w[ids] + p[:6] + t[0])  # default token type 0
    pos = torch.tensor([5, 4, 3, 2, 1, 0])
    torch.testing.assert_close(m(ids, pos), w[ids] + p[pos] + t[0])
    bare = BertEmbeddings(10, 40, 0, 0)
    assert set(bare.state_dict()) == {"word_embeddings.weight"}
    torch.testing.assert_close(bare(ids), bare.word_embeddings.weight[ids])


def test_parallel_embeddings_without_group_are_plain():
    v = VocabParallelEmbedding(20, 4, padding_idx=1)
    ids = torch.randint(0, 20, (2, 3))
    torch.testing.assert_close(v(ids), v.weight[ids])
    c = ColumnParallelEmbedding(20, 4)
    assert c.weight.shape == (20, 4) and c.process_group is None
