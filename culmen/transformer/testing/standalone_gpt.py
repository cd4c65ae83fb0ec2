"""``apex.transformer.testing.standalone_gpt``: the GPT of Apex's model-parallel tests (causal
``TransformerLanguageModel`` with logits tied to the word embeddings), on culmen's layers.

Differences from Apex: the per-token loss is returned ``[b, s]`` like the labels (Apex returned it
``[s, b]``, so a real loss mask of shape ``[b, s]`` weighted the wrong tokens), and without labels the
logits are returned ``[b, s, vocab / tp]`` (Apex failed transposing ``None``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from culmen.transformer import parallel_state
from culmen.transformer.enums import AttnMaskType
from culmen.transformer.testing.global_vars import get_args
from culmen.transformer.testing.standalone_transformer_lm import (
    MegatronModule,
    _forward_context,
    get_language_model,
    init_method_normal,
    module_size,
    post_language_model_processing,
    scaled_init_method_normal,
)

__all__ = ["GPTModel", "gpt_model_provider"]


class GPTModel(MegatronModule):
    """GPT-2 language model (one pipeline chunk).

    Args:
        num_tokentypes: token-type rows of the embedding (0 for GPT).
        parallel_output: keep the logits split over the TP ranks (the loss needs no gather).
        pre_process, post_process: this chunk is the first / last pipeline stage.
        cpu_offload: keep saved activations in host memory (``torch.autograd.graph.save_on_cpu``).

    ``forward(input_ids [b, s], position_ids [b, s], attention_mask, labels=None, tokentype_ids=None,
    inference_params=None)``, the mask bool ``[b or 1, 1, s, s]`` True where masked
    (``pipeline_parallel.utils.get_ltor_masks_and_position_ids``): on the last stage the per-token loss
    ``[b, s]`` (fp32 for 16-bit models) given ``labels [b, s]``, else the logits ``[b, s, vocab / tp]``;
    on other stages the hidden states ``[s, b, h]`` for the next stage.
    """

    def __init__(self, num_tokentypes: int = 0, parallel_output: bool = True, pre_process: bool = True,
                 post_process: bool = True, cpu_offload: bool = False) -> None:
        super().__init__()
        args = get_args()
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = args.fp16_lm_cross_entropy
        self.cpu_offload = cpu_offload
        self._forward_context = _forward_context(cpu_offload)
        self.language_model, self._language_model_key = get_language_model(
            num_tokentypes=num_tokentypes, add_pooler=False, encoder_attn_mask_type=AttnMaskType.causal,
            init_method=init_method_normal(args.init_method_std),
            scaled_init_method=scaled_init_method_normal(args.init_method_std, args.num_layers),
            pre_process=pre_process, post_process=post_process)
        self.initialize_word_embeddings(init_method_normal)

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor] | None) -> None:
        """The activation received from the previous pipeline stage."""
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids: Tensor | None, position_ids: Tensor | None, attention_mask: Tensor | None,
                labels: Tensor | None = None, tokentype_ids: Tensor | None = None,
                inference_params: Any = None) -> Tensor:
        with self._forward_context():
            lm_output = self.language_model(input_ids, position_ids, attention_mask, tokentype_ids=tokentype_ids,
                                            inference_params=inference_params)
            if not self.post_process:
                return lm_output
            labels_sb = None if labels is None else labels.transpose(0, 1).contiguous()
            out = post_language_model_processing(lm_output, labels_sb, self.word_embeddings_weight(),
                                                 self.parallel_output, self.fp16_lm_cross_entropy)
            return out.transpose(0, 1).contiguous()

    def state_dict_for_save_checkpoint(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """``{"language_model": ..., "word_embeddings_for_head": ...}`` (the latter on a last stage that
        holds a copy of the word embeddings)."""
        state = {self._language_model_key: self.language_model.state_dict_for_save_checkpoint(
            prefix=prefix, keep_vars=keep_vars)}
        if self.post_process and not self.pre_process:
            state[self._word_embeddings_for_head_key] = self.word_embeddings.state_dict(prefix=prefix,
                                                                                       keep_vars=keep_vars)
        return state

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load either ``state_dict_for_save_checkpoint``'s nested form or a plain ``state_dict``."""
        if self._language_model_key not in state_dict:
            return super().load_state_dict(state_dict, strict=strict)
        if self.post_process and not self.pre_process:
            self.word_embeddings.load_state_dict(state_dict[self._word_embeddings_for_head_key], strict=strict)
        return self.language_model.load_state_dict(state_dict[self._language_model_key], strict=strict)


def gpt_model_provider(pre_process: bool = True, post_process: bool = True, cpu_offload: bool = False) -> GPTModel:
    """Build this pipeline chunk's ``GPTModel`` from ``get_args()`` (``cpu_offload`` or ``args.cpu_offload``);
    rank 0 prints the model's parameter count over all model-parallel ranks."""
    args = get_args()
    model = GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process, post_process=post_process,
                     cpu_offload=bool(cpu_offload or args.cpu_offload))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        n_params = (module_size(model) * parallel_state.get_tensor_model_parallel_world_size()
                    * parallel_state.get_pipeline_model_parallel_world_size())
        print(f"Initialized GPT-2 w/: pre_process={pre_process}, post_process={post_process}, "
              f"cpu_offload={model.cpu_offload}; Number of Parameters: {n_params}", flush=True)
    return model
