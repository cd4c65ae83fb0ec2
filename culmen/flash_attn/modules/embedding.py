"""flash_attn 2.8's ``flash_attn.modules.embedding`` on culmen: token + position (+ token type) embeddings
and their tensor-parallel forms, with flash_attn's parameter names (``word_embeddings``,
``position_embeddings``, ``token_type_embeddings``, ``project_in``).

Tensor parallelism: ``VocabParallelEmbedding`` splits the vocabulary (rows) over the ranks: a rank looks up
the ids in its range and gives zeros elsewhere, so the sum over ranks is the full lookup;
``ColumnParallelEmbedding`` splits the embedding dim. ``ParallelGPT2Embeddings`` adds this rank's position
columns into its partial sum and then all-reduces it (or reduce-scatters it over the flattened tokens,
with ``sequence_parallel``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from culmen.flash_attn.utils.distributed import all_reduce, reduce_scatter

__all__ = [
    "BertEmbeddings",
    "ColumnParallelEmbedding",
    "GPT2Embeddings",
    "ParallelGPT2Embeddings",
    "VocabParallelEmbedding",
]


def _positions(input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)


def _check_ids(input_ids: Tensor) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seqlen) tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")


class GPT2Embeddings(nn.Module):
    """Word + learned position embeddings.

    Args:
        embed_dim: output width. vocab_size: rows of ``word_embeddings``.
        max_position_embeddings: rows of ``position_embeddings``; ``<= 0`` means no position embeddings.
        padding_idx: ``nn.Embedding``'s. word_embed_proj_dim: embed words to this width, then project up
            to ``embed_dim`` with ``project_in`` (a bias-free linear; OPT-350m).
        device, dtype: factory kwargs.
    """

    def __init__(self, embed_dim: int, vocab_size: int, max_position_embeddings: int, padding_idx: int | None = None,
                 word_embed_proj_dim: int | None = None, device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if word_embed_proj_dim is None:
            self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx, **factory)
            self.project_in = None
        else:
            self.word_embeddings = nn.Embedding(vocab_size, word_embed_proj_dim, padding_idx=padding_idx, **factory)
            self.project_in = nn.Linear(word_embed_proj_dim, embed_dim, bias=False, **factory)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """``input_ids`` ``(B, S)``; ``position_ids`` ``(B, S)`` or ``(S,)`` (default ``0..S-1``).
        Returns ``(B, S, embed_dim)``."""
        _check_ids(input_ids)
        embeddings = self.word_embeddings(input_ids)
        if self.project_in is not None:
            embeddings = self.project_in(embeddings)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        return embeddings


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings (BERT).

    Args:
        embed_dim, vocab_size, max_position_embeddings (``<= 0``: none), padding_idx, device, dtype: as
            ``GPT2Embeddings``. type_vocab_size: rows of ``token_type_embeddings``; ``<= 0`` means none.
    """

    def __init__(self, embed_dim: int, vocab_size: int, max_position_embeddings: int, type_vocab_size: int,
                 padding_idx: int | None = None, device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx, **factory)
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)
        if type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(type_vocab_size, embed_dim, **factory)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """``input_ids`` ``(B, S)``; ``position_ids`` default ``0..S-1``; ``token_type_ids`` default all 0.
        Returns ``(B, S, embed_dim)``."""
        _check_ids(input_ids)
        embeddings = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        if self.type_vocab_size > 0:
            if token_type_ids is None:
                token_type_ids = torch.zeros(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return embeddings


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` whose rows (the vocabulary) are split evenly over ``process_group``: this rank
    holds rows ``rank * V / world`` to ``(rank + 1) * V / world`` and returns zeros for ids outside them,
    so summing the ranks' outputs gives the full lookup. Without a group it is a plain embedding.

    Args: ``nn.Embedding``'s (``num_embeddings`` is the full vocabulary), plus keyword process_group.
    ``padding_idx`` is not supported with more than one rank.
    """

    def __init__(self, num_embeddings: int, *args, process_group: ProcessGroup | None = None,
                 padding_idx: int | None = None, **kwargs) -> None:
        world = torch.distributed.get_world_size(process_group) if process_group is not None else 1
        if num_embeddings % world:
            raise ValueError(f"num_embeddings ({num_embeddings}) must be divisible by the world size ({world})")
        if world > 1 and padding_idx is not None:
            raise ValueError(f"VocabParallelEmbedding does not support padding_idx ({padding_idx}) with "
                             f"{world} ranks")
        super().__init__(num_embeddings // world, *args, padding_idx=padding_idx, **kwargs)
        self.process_group = process_group
        self._start = 0 if process_group is None else torch.distributed.get_rank(process_group) * self.num_embeddings

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Embedding's argument name)
        """``input``: integer ids of any shape (full-vocabulary ids); returns ``input.shape + (dim,)``:
        this rank's share (zeros for ids it does not hold)."""
        if self.process_group is None:
            return super().forward(input)
        local = input - self._start
        outside = (local < 0) | (local >= self.num_embeddings)
        emb = super().forward(local.masked_fill(outside, 0))
        return emb.masked_fill(outside.unsqueeze(-1), 0.0)


class ColumnParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` whose embedding dim is split evenly over ``process_group`` (this rank holds
    columns ``rank * D / world`` to ``(rank + 1) * D / world``).

    Args: ``nn.Embedding``'s (``embedding_dim`` is the full width), plus keyword process_group.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, process_group: ProcessGroup | None = None,
                 **kwargs) -> None:
        world = torch.distributed.get_world_size(process_group) if process_group is not None else 1
        if embedding_dim % world:
            raise ValueError(f"embedding_dim ({embedding_dim}) must be divisible by the world size ({world})")
        super().__init__(num_embeddings, embedding_dim // world, *args, **kwargs)
        self.process_group = process_group


class ParallelGPT2Embeddings(nn.Module):
    """Tensor-parallel ``GPT2Embeddings``: vocabulary-parallel words, column-parallel positions.

    Args: embed_dim, vocab_size, max_position_embeddings (``<= 0``: none), process_group, padding_idx,
        sequence_parallel (the output is this rank's rows of the flattened ``(B * S, embed_dim)``
        tokens; else the whole output on every rank), device, dtype.
    """

    def __init__(self, embed_dim: int, vocab_size: int, max_position_embeddings: int, process_group: ProcessGroup,
                 padding_idx: int | None = None, sequence_parallel: bool = True, device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is None:
            raise ValueError("ParallelGPT2Embeddings needs a process_group")
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                                      process_group=process_group, **factory)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = ColumnParallelEmbedding(max_position_embeddings, embed_dim,
                                                               process_group=process_group, **factory)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                combine_batch_seqlen_dim: bool = False) -> Tensor:
        """``input_ids`` ``(B, S)``. Returns ``(B, S, embed_dim)`` (or ``(B * S, embed_dim)`` with
        ``combine_batch_seqlen_dim``), reduce-scattered along dim 0 when sequence parallel (then dim 0
        must divide by the world size: combine the batch and sequence dims)."""
        _check_ids(input_ids)
        world = torch.distributed.get_world_size(self.process_group)
        embeddings = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            pos = self.position_embeddings(_positions(input_ids, position_ids))
            if world <= 1:
                embeddings = embeddings + pos
            else:
                width = self.position_embeddings.embedding_dim
                start = torch.distributed.get_rank(self.process_group) * width
                # Only this rank's columns get positions: the all-reduce then sums each column once.
                embeddings[..., start:start + width] += pos
        if combine_batch_seqlen_dim:
            embeddings = embeddings.flatten(0, 1)
        if world <= 1:
            return embeddings
        return (reduce_scatter if self.sequence_parallel else all_reduce)(embeddings, self.process_group)
