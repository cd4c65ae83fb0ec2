"""Upstream facts for the name-by-name API check of ``apex.RNN`` and the ``apex.contrib`` long tail.

Each entry is ``(name, kind, signature)`` per upstream module path (``apex.<path>``), recorded from NVIDIA/apex
(apex/RNN at e13873de; contrib.fmha / multihead_attn at 526871a2^; gpu_direct_storage at 6424da3b^; the other
contrib packages at 6424da3b) as far as the stored copies allow (see ``SOURCES``).

Counting rule (as in the API audit): every top-level function, class or non-constant alias not starting with
``_`` in every non-test module, plus the names a package ``__init__`` re-exports. ``X = Fn.apply`` aliases are
functions with ``forward``'s parameters minus ``ctx``.

Kinds:
  ``"function"``  signature = the parameter list.
  ``"module"``    ``nn.Module`` subclass; signature = ``(init_params, forward_params)``.
  ``"class"``     other class; signature = ``init_params`` (``None``: the class defines no ``__init__``).
  ``"autograd"``  ``torch.autograd.Function``; signature = ``forward``'s parameters without ``ctx``
                  (what ``Fn.apply`` takes).
  ``"value"``     module-level setting (checked for presence only).

A parameter list holds ``"name"`` (required), ``("name", default)``, ``"*args"`` / ``"**kwargs"`` style
entries, and ``"*"`` for the start of keyword-only parameters.
"""

from __future__ import annotations

SOURCES = {
    "apex.RNN": "RNNBackend.py @1feac980 (last change before e13873de), cells.py / models.py / __init__.py @2fa4dbaf",
    "apex.contrib.sparsity": "permutation_utilities.py: newest stored version (18 names, as at 6424da3b); "
                             "channel_swap.py @52542f1e; exhaustive_search.py @1feac980; sparse_masklib.py @0441afde",
    "apex.contrib.multihead_attn": "forward signatures from the stored *_func.py copies (526871a2^ era)",
    "apex.contrib.torchsched": "stored copies @00e4cad4 / 0d068a8e / 16fadfe7 (6424da3b era)",
}

_MODEL_FACTORY = ["input_size", "hidden_size", "num_layers", ("bias", True), ("batch_first", False),
                  ("dropout", 0), ("bidirectional", False), ("output_size", None)]
_CONV_BWD = ["grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
             "output_padding", "groups", "output_mask"]
_LN_BWD = ["d_y", "x_mean", "x_invstd", "x", "normalized_shape", "weight", "bias"]
_MHA_FWD = ["query", "key", "value", ("key_padding_mask", None), ("need_weights", False), ("attn_mask", None),
            ("is_training", True)]
_SELF_ATTN = ["use_time_mask", "is_training", "heads", "scale", "inputs", "input_weights", "output_weights",
              "input_biases", "output_biases", "mask", "is_additive_mask", "dropout_prob"]
_ENCDEC_ATTN = ["use_time_mask", "is_training", "heads", "scale", "inputs_q", "inputs_kv", "input_weights_q",
                "input_weights_kv", "output_weights", "input_biases_q", "input_biases_kv", "output_biases", "mask",
                "dropout_prob"]
_FAST_ENCDEC = ["use_time_mask", "is_training", "heads", "inputs_q", "inputs_kv", "input_weights_q",
                "input_weights_kv", "output_weights", "pad_mask", "dropout_prob"]
_FAST_ENCDEC_NA = ["use_time_mask", "is_training", "heads", "inputs_q", "inputs_kv", "lyr_nrm_gamma_weights",
                   "lyr_nrm_beta_weights", "input_weights_q", "input_weights_kv", "output_weights", "pad_mask",
                   "dropout_prob"]
_FAST_SELF = ["use_time_mask", "is_training", "heads", "inputs", "input_weights", "output_weights", "input_biases",
              "output_biases", "pad_mask", "mask_additive", "dropout_prob"]
_FAST_SELF_NA = ["use_time_mask", "is_training", "heads", "inputs", "lyr_nrm_gamma_weights", "lyr_nrm_beta_weights",
                 "input_weights", "output_weights", "pad_mask", "dropout_prob"]
_MASK_SOFTMAX = ["is_training", "heads", "inputs", "pad_mask", "mask_additive", "dropout_prob"]
_JIT_DROPOUT_ADD = ["x", "residual", "prob", "is_training"]
_BN_NHWC = ["x", "s", "b", "rm", "riv", "mini_m", "mini_riv", "ret_cta", "mom", "epsilon", "fuse_relu", "is_train",
            "bn_group", "my_data", "pair_data", "magic", "pair_data2", "pair_data3", "fwd_occup", "fwd_grid_x",
            "bwd_occup", "bwd_grid_x", "multi_stream"]
_BN_ADDRELU_NHWC = ["x", "z", "s", "b", "rm", "riv", "mini_m", "mini_riv", "grid_dim_y", "ret_cta", "mom", "epsilon",
                    "is_train", "bn_group", "my_data", "pair_data", "magic", "pair_data2", "pair_data3", "fwd_occup",
                    "fwd_grid_x", "bwd_occup", "bwd_grid_x", "multi_stream"]
_SPATIAL_BOTTLENECK = ["spatial_group_size", "spatial_group_rank", "spatial_communicator", "spatial_halo_exchanger",
                       "spatial_method", "use_delay_kernel", "explicit_nhwc", "stride_1x1", "scale", "bias",
                       "thresholdTop", "thresholdBottom", "x", "*conv"]
_HALO_BASE = ["ranks", "rank_in_group"]
_BOTTLENECK_INIT = ["in_channels", "bottleneck_channels", "out_channels", ("stride", 1), ("groups", 1),
                    ("dilation", 1), ("norm_func", None), ("use_cudnn", False), ("explicit_nhwc", False)]

UPSTREAM: dict[str, list[tuple]] = {
    # ------------------------------------------------------------------ apex.RNN
    "apex.RNN": [(n, "function", _MODEL_FACTORY) for n in ("LSTM", "GRU", "ReLU", "Tanh", "mLSTM")],
    "apex.RNN.RNNBackend": [
        ("is_iterable", "function", ["maybe_iterable"]),
        ("flatten_list", "function", ["tens_list"]),
        ("bidirectionalRNN", "module", (["inputRNN", ("num_layers", 1), ("dropout", 0)],
                                        ["input", ("collect_hidden", False)])),
        ("stackedRNN", "module", (["inputRNN", ("num_layers", 1), ("dropout", 0)],
                                  ["input", ("collect_hidden", False), ("reverse", False)])),
        ("RNNCell", "module", (["gate_multiplier", "input_size", "hidden_size", "cell", ("n_hidden_states", 2),
                                ("bias", False), ("output_size", None)], ["input"])),
    ],
    "apex.RNN.cells": [
        ("mLSTMRNNCell", "module", (["input_size", "hidden_size", ("bias", False), ("output_size", None)], ["input"])),
        ("mLSTMCell", "function", ["input", "hidden", "w_ih", "w_hh", "w_mih", "w_mhh", ("b_ih", None),
                                   ("b_hh", None)]),
    ],
    "apex.RNN.models": [
        ("toRNNBackend", "function", ["inputRNN", "num_layers", ("bidirectional", False), ("dropout", 0)]),
        *[(n, "function", _MODEL_FACTORY) for n in ("LSTM", "GRU", "ReLU", "Tanh", "mLSTM")],
    ],
    # ------------------------------------------------------------------ transducer
    "apex.contrib.transducer": [
        ("TransducerJoint", "module", None),
        ("TransducerLoss", "module", None),
    ],
    "apex.contrib.transducer.transducer": [
        ("TransducerJoint", "module", ([("pack_output", False), ("relu", False), ("dropout", False), ("opt", 1),
                                        ("fwd_tile_size", 4), ("dropout_prob", 0), ("probe_mask", False)],
                                       ["f", "g", "f_len", "g_len", ("batch_offset", None), ("packed_batch", 0)])),
        ("TransducerLoss", "module", ([("fuse_softmax_backward", True), ("opt", 1), ("packed_input", False)],
                                      ["x", "label", "f_len", "y_len", "blank_idx", ("batch_offset", None),
                                       ("max_f_len", None), ("debug_list", None)])),
        ("TransducerLossFunc", "autograd", ["x", "label", "f_len", "y_len", "batch_offset", "max_f_len", "blank_idx",
                                            "fuse_softmax_backward", "debug_list", "opt", "packed_input"]),
        ("TransducerJointFunc", "autograd", ["f", "g", "f_len", "g_len", "pack_output", "relu", "dropout",
                                             "batch_offset", "packed_batch", "opt", "fwd_tile_size", "dropout_prob",
                                             "mask_probe"]),
    ],
    # ------------------------------------------------------------------ sparsity
    "apex.contrib.sparsity": [
        ("ASP", "class", None),
        ("create_mask", "function", ["tensor", ("pattern", "m4n2_1d"), ("density", 0.5)]),
    ],
    "apex.contrib.sparsity.asp": [
        ("eligible_modules", "function", ["model", "whitelist_layer_types", "allowed_layer_names",
                                          "disallowed_layer_names"]),
        ("ASP", "class", None),
    ],
    "apex.contrib.sparsity.sparse_masklib": [
        ("fill", "function", ["x"]),
        ("reshape_1d", "function", ["matrix", "m"]),
        ("compute_valid_1d_patterns", "function", ["m", "n"]),
        ("mn_1d_best", "function", ["matrix", "m", "n"]),
        ("m4n2_1d", "function", ["mat", "density"]),
        ("mn_2d_greedy", "function", ["matrix", "m", "n"]),
        ("m4n2_2d_greedy", "function", ["mat", "density"]),
        ("compute_valid_2d_patterns", "function", ["m", "n"]),
        ("mn_2d_best", "function", ["matrix", "m", "n"]),
        ("m4n2_2d_best", "function", ["mat", "density"]),
        ("create_mask", "function", ["tensor", ("pattern", "m4n2_1d"), ("density", 0.5)]),
    ],
    "apex.contrib.sparsity.permutation_lib": [
        ("convert_fx_node_name", "function", ["fx_node_name"]),
        ("get_node_parent_children", "function", ["fx_node"]),
        ("node_name_matches", "function", ["node_name", "module_name"]),
        ("replicate_sequence", "function", ["sequence", "replications"]),
        ("Permutation", "class", None),
    ],
    "apex.contrib.sparsity.permutation_search_kernels": [
        ("accelerated_search_for_good_permutation", "function", ["matrix_group", ("options", None)]),
        ("sum_after_2_to_4", "function", ["matrix"]),
    ],
    "apex.contrib.sparsity.permutation_search_kernels.call_permutation_search_kernels": [
        ("accelerated_search_for_good_permutation", "function", ["matrix_group", ("options", None)]),
    ],
    "apex.contrib.sparsity.permutation_search_kernels.channel_swap": [
        ("try_swap", "function", ["matrix", "dst", "src"]),
        ("stripes_and_swap_idx_to_columns", "function", ["stripe0", "stripe1", "idx"]),
        ("columns_to_stripes_and_swap_idx", "function", ["col0", "col1"]),
        ("build_stripe_pairs", "function", ["matrix", "used_stripes"]),
        ("compute_swap_map", "function", ["matrix", "used_stripes"]),
        ("build_swap_map", "function", ["matrix", "swap_map", "swap_ids", "used_stripes", "verbosity"]),
        ("use_swap_map", "function", ["matrix", "swap_map", "swap_ids", "threshold", "used_escape_attempts",
                                      "escape_attempts", "permutation", "verbosity"]),
        ("Channel_Swap", "function", ["matrix", ("escape_attempts", 0), ("verbosity", 0), ("permutation", None)]),
    ],
    "apex.contrib.sparsity.permutation_search_kernels.exhaustive_search": [
        ("is_canonical", "function", ["perm", "col"]),
        ("generate_unique_combinations", "function", ["built_permutation", "remaining_columns",
                                                      "full_permutation_list", "group_width"]),
        ("generate_all_unique_combinations", "function", ["C", "M", ("must_use_all_groups", False)]),
        ("predict_unique_combinations", "function", ["C", "M"]),
        ("search_matrix", "function", ["matrix", "group_width"]),
        ("collect_stripes", "function", ["matrix", "stripes", "group_width"]),
        ("apply_stripe_group_permutation", "function", ["sgp", "stripes", "group_width", "permutation"]),
        ("generate_stripe_groups", "function", ["num_stripes", "window_size"]),
        ("build_stripe_map", "function", ["matrix", "group_width", "window_size", "stripe_map", "stripe_ids",
                                          "perm_map", "used_stripes"]),
        ("use_stripe_map", "function", ["matrix", "group_width", "stripe_map", "stripe_ids", "perm_map",
                                        "permutation"]),
        ("Exhaustive_Search", "function", ["matrix", ("stripe_group_size", -1), ("escape_attempts", 0),
                                           ("permutation", None)]),
    ],
    "apex.contrib.sparsity.permutation_search_kernels.permutation_utilities": [
        ("use_gpu", "function", [("initial_override", True)]),
        ("apply_2_to_4", "function", ["matrix"]),
        ("sum_after_2_to_4", "function", ["matrix"]),
        ("unstructured_prune", "function", ["matrix", "sparsity"]),
        ("try_swap", "function", ["matrix", "dst", "src"]),
        ("efficacy", "function", ["optimal_lost_magnitude", "base_lost_magnitude", "cur_lost_magnitude"]),
        ("magnitude_after_pruning_rows", "function", ["matrix", ("rate", 0.5)]),
        ("try_permutations_on_matrix", "function", ["matrix", "permutations"]),
        ("find_permutation", "function", ["A", "B"]),
        ("make_grouped", "function", ["A"]),
        ("common_groups", "function", ["A", "B"]),
        ("remove_common_groups", "function", ["A", "B"]),
        ("group_differences", "function", ["A", "B"]),
        ("dictify", "function", ["wrong_entries"]),
        ("move_groups_to_match", "function", ["B", "A", ("debug", False)]),
        ("swap_and_correct", "function", ["permutation", "src", "tgt"]),
        ("move_permutation_towards", "function", ["B", "A", ("debug", False)]),
        ("permutation_distance", "function", ["A", "B", ("matrix", None), ("magnitude_targets", None),
                                              ("debug", False), ("verbosity", 0)]),
    ],
    # ------------------------------------------------------------------ multihead_attn (526871a2^)
    "apex.contrib.multihead_attn": [
        ("SelfMultiheadAttn", "module", None),
        ("EncdecMultiheadAttn", "module", None),
        ("fast_mask_softmax_dropout_func", "function", _MASK_SOFTMAX),
    ],
    "apex.contrib.multihead_attn.self_multihead_attn": [
        ("jit_dropout_add", "function", _JIT_DROPOUT_ADD),
        ("SelfMultiheadAttn", "module", (["embed_dim", "num_heads", ("dropout", 0.0), ("bias", False),
                                          ("include_norm_add", False), ("impl", "fast"),
                                          ("separate_qkv_params", False), ("mask_additive", False)], _MHA_FWD)),
    ],
    "apex.contrib.multihead_attn.encdec_multihead_attn": [
        ("jit_dropout_add", "function", _JIT_DROPOUT_ADD),
        ("EncdecMultiheadAttn", "module", (["embed_dim", "num_heads", ("dropout", 0.0), ("bias", False),
                                            ("include_norm_add", False), ("impl", "fast")], _MHA_FWD)),
    ],
    "apex.contrib.multihead_attn.self_multihead_attn_func": [
        ("SelfAttnFunc", "autograd", _SELF_ATTN), ("self_attn_func", "function", _SELF_ATTN)],
    "apex.contrib.multihead_attn.encdec_multihead_attn_func": [
        ("EncdecAttnFunc", "autograd", _ENCDEC_ATTN), ("encdec_attn_func", "function", _ENCDEC_ATTN)],
    "apex.contrib.multihead_attn.fast_self_multihead_attn_func": [
        ("FastSelfAttnFunc", "autograd", _FAST_SELF), ("fast_self_attn_func", "function", _FAST_SELF)],
    "apex.contrib.multihead_attn.fast_self_multihead_attn_norm_add_func": [
        ("FastSelfAttnNormAddFunc", "autograd", _FAST_SELF_NA),
        ("fast_self_attn_norm_add_func", "function", _FAST_SELF_NA)],
    "apex.contrib.multihead_attn.fast_encdec_multihead_attn_func": [
        ("FastEncdecAttnFunc", "autograd", _FAST_ENCDEC), ("fast_encdec_attn_func", "function", _FAST_ENCDEC)],
    "apex.contrib.multihead_attn.fast_encdec_multihead_attn_norm_add_func": [
        ("FastEncdecAttnNormAddFunc", "autograd", _FAST_ENCDEC_NA),
        ("fast_encdec_attn_norm_add_func", "function", _FAST_ENCDEC_NA)],
    "apex.contrib.multihead_attn.mask_softmax_dropout_func": [
        ("MaskSoftmaxDropout", "autograd", _MASK_SOFTMAX),
        ("fast_mask_softmax_dropout_func", "function", _MASK_SOFTMAX)],
    # ------------------------------------------------------------------ fmha (526871a2^)
    "apex.contrib.fmha": [("FMHAFun", "autograd", None), ("FMHA", "module", None)],
    "apex.contrib.fmha.fmha": [
        ("FMHAFun", "autograd", ["qkv", "cu_seqlens", "p_dropout", "max_s", "is_training", "zero_tensors"]),
        ("FMHA", "module", (["config"], ["qkv", "cu_seqlens", "max_s", ("is_training", True),
                                         ("zero_tensors", False)])),
    ],
    # ------------------------------------------------------------------ openfold_triton
    "apex.contrib.openfold_triton": [
        ("LayerNormSmallShapeOptImpl", "autograd", None), ("FusedAdamSWA", "class", None),
        ("AttnTri", "function", None), ("CanSchTriMHA", "function", None),
        ("AttnBiasJIT", "function", None), ("AttnNoBiasJIT", "function", None),
    ],
    "apex.contrib.openfold_triton.fused_adam_swa": [
        ("AdamMathType", "class", None),
        ("FusedAdamSWA", "class", ["params", "compute_params", "swa_params", "swa_decay_rate", ("lr", 1e-3),
                                   ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-8),
                                   ("adam_math_mode", "<AdamMathType.PyTorchAdam>"), ("weight_decay", 0.0),
                                   ("amsgrad", False), ("set_grad_none", True), ("capturable", False),
                                   ("master_weights", False)]),
    ],
    "apex.contrib.openfold_triton.layer_norm": [
        ("LayerNormSmallShapeOptImpl", "autograd", ["inputs", "normalized_shape", "weight", "bias", ("eps", 1e-05)]),
    ],
    "apex.contrib.openfold_triton.mha": [
        ("is_enabled", "function", []),
        ("enable", "function", []),
        ("disable", "function", []),
        ("CanSchTriMHA", "function", ["in_shape", ("has_bias", True), ("inf", 1e9), ("training", True)]),
        ("schedule_triton_mha", "function", ["in_shape", ("fwd", True)]),
        ("FusedAttenionCoreFunc", "autograd", ["q", "k", "v", ("mask", None), ("bias", None), ("inf", 1e9),
                                               ("is_training", True)]),
        ("AttnTri", "function", ["q", "k", "v", ("mask", None), ("bias", None), ("inf", 1e9),
                                 ("is_training", True)]),
        ("AttnBiasJIT", "function", ["query", "key", "value", "mask", "bias", "inf"]),
        ("AttnNoBiasJIT", "function", ["query", "key", "value", "mask", "inf"]),
    ],
    # ------------------------------------------------------------------ conv_bias_relu
    "apex.contrib.conv_bias_relu": [(n, "function", None) for n in
                                    ("ConvBiasReLU", "ConvBias", "ConvBiasMaskReLU", "ConvFrozenScaleBiasReLU")],
    "apex.contrib.conv_bias_relu.conv_bias_relu": [
        ("ConvBiasReLU_", "autograd", ["x", "weight", "bias", "padding", "stride"]),
        ("ConvBiasMaskReLU_", "autograd", ["x", "weight", "bias", "mask", "padding", "stride"]),
        ("ConvBias_", "autograd", ["x", "weight", "bias", "padding", "stride"]),
        ("ConvFrozenScaleBiasReLU_", "autograd", ["x", "weight", "scale", "bias", "padding", "stride"]),
        ("ConvBiasReLU", "function", ["x", "weight", "bias", "padding", "stride"]),
        ("ConvBiasMaskReLU", "function", ["x", "weight", "bias", "mask", "padding", "stride"]),
        ("ConvBias", "function", ["x", "weight", "bias", "padding", "stride"]),
        ("ConvFrozenScaleBiasReLU", "function", ["x", "weight", "scale", "bias", "padding", "stride"]),
    ],
    # ------------------------------------------------------------------ bottleneck
    "apex.contrib.bottleneck": [
        ("Bottleneck", "module", None), ("SpatialBottleneck", "module", None),
        ("HaloExchangerNoComm", "class", None), ("HaloExchangerAllGather", "class", None),
        ("HaloExchangerSendRecv", "class", None), ("HaloExchangerPeer", "class", None),
    ],
    "apex.contrib.bottleneck.bottleneck": [
        ("kaiming_uniform_", "function", ["tensor", ("a", 0), ("mode", "fan_in"), ("nonlinearity", "leaky_relu")]),
        ("compute_scale_bias_one", "function", ["nhwc", "weight", "bias", "running_mean", "running_var", "w_scale",
                                                "w_bias"]),
        ("compute_scale_bias_method", "function", ["nhwc", "args"]),
        ("FrozenBatchNorm2d", "module", (["n"], ["x"])),
        ("drelu_dscale1", "function", ["grad_o", "output", "scale1"]),
        ("drelu_dscale2", "function", ["grad_o", "output", "scale1", "scale2"]),
        ("BottleneckFunction", "autograd", ["nhwc", "stride_1x1", "scale", "bias", "x", "*conv"]),
        ("bottleneck_function", "function", ["nhwc", "stride_1x1", "scale", "bias", "x", "*conv"]),
        ("conv3x3", "function", ["in_planes", "out_planes", ("stride", 1), ("groups", 1), ("dilation", 1)]),
        ("conv1x1", "function", ["in_planes", "out_planes", ("stride", 1)]),
        ("Bottleneck", "module", (_BOTTLENECK_INIT, ["x"])),
        ("SpatialBottleneckFunction", "autograd", _SPATIAL_BOTTLENECK),
        ("spatial_bottleneck_function", "function", _SPATIAL_BOTTLENECK),
        ("SpatialBottleneck", "module", (_BOTTLENECK_INIT + [("spatial_parallel_args", None)], ["x"])),
    ],
    "apex.contrib.bottleneck.halo_exchangers": [
        ("HaloExchanger", "class", _HALO_BASE),
        ("HaloExchangerNoComm", "class", _HALO_BASE),
        ("HaloExchangerAllGather", "class", _HALO_BASE + ["comm"]),
        ("HaloExchangerSendRecv", "class", _HALO_BASE),
        ("HaloExchangerPeer", "class", _HALO_BASE + ["peer_pool", "explicit_nhwc", ("numSM", 1)]),
        ("HaloPadder", "class", ["halo_ex"]),
    ],
    # ------------------------------------------------------------------ groupbn / cudnn_gbn
    "apex.contrib.groupbn": [("BatchNorm2d_NHWC", "module", None)],
    "apex.contrib.groupbn.batch_norm": [
        ("bn_NHWC_impl", "autograd", _BN_NHWC),
        ("bn_addrelu_NHWC_impl", "autograd", _BN_ADDRELU_NHWC),
        ("BatchNorm2d_NHWC", "module", (["num_features", ("fuse_relu", False), ("bn_group", 1),
                                         ("max_cta_per_sm", 2), ("cta_launch_margin", 12), ("multi_stream", False)],
                                        ["x", ("z", None)])),
    ],
    "apex.contrib.cudnn_gbn": [("GroupBatchNorm2d", "module", None)],
    "apex.contrib.cudnn_gbn.batch_norm": [
        ("GroupBatchNorm2d", "module", (["num_features", "group_size", ("eps", 1e-5), ("momentum", 0.1),
                                         ("affine", True), ("track_running_stats", True)], ["input"])),
    ],
    # ------------------------------------------------------------------ peer_memory / nccl_allocator / gds
    "apex.contrib.peer_memory": [("PeerMemoryPool", "class", None), ("PeerHaloExchanger1d", "class", None)],
    "apex.contrib.peer_memory.peer_memory": [
        ("PeerMemoryPool", "class", ["static_size", "dynamic_size", ("peer_ranks", None)]),
    ],
    "apex.contrib.peer_memory.peer_halo_exchanger_1d": [
        ("PeerHaloExchanger1d", "class", ["ranks", "rank_in_group", "peer_pool", "half_halo"]),
    ],
    "apex.contrib.nccl_allocator": [
        ("init", "function", []), ("nccl_mem", "class", None), ("create_nccl_mem_pool", "function", None)],
    "apex.contrib.nccl_allocator.nccl_allocator": [
        ("get_func_args", "function", ["func"]),
        ("create_nccl_mem_pool", "function", [("symmetric", None)]),
        ("init", "function", []),
        ("nccl_mem", "class", ["pool", ("enabled", True), ("device", None), ("group", None)]),
    ],
    "apex.contrib.gpu_direct_storage": [("GDSFile", "class", ["filename", "mode"])],
    # ------------------------------------------------------------------ torchsched
    "apex.contrib.torchsched": [
        ("torchsched", "function", ["model_", "example_inputs_", ("inner_compile", "<compile_fx_inner>"),
                                    ("config_patches", None), ("decompositions", None)]),
        ("set_default_backend", "function", ["backend"]),
        ("torchsched_compile", "function", ["*args", "*", ("backend", None), "**kwargs"]),
        ("get_backend", "function", [("backend", "torch"), ("scheme", "dwb")]),
    ],
    "apex.contrib.torchsched.backend": [
        ("enable_multi_stream_scheduling", "function", ["compile_fn"]),
        ("convolution_backward_decomp_dwb", "function", _CONV_BWD),
        ("convolution_backward_decomp_wbd", "function", _CONV_BWD),
        ("DecompositionsWrapper", "class", ["mode", "options", "dynamic", "decompositions"]),
        ("get_backend", "function", [("backend", "torch"), ("scheme", "dwb")]),
    ],
    "apex.contrib.torchsched.config": [
        (n, "value", None) for n in ("debug", "pre_grad_pass_options", "num_streams", "skip_post_grad_graph_ids",
                                     "reuse_cuda_event")
    ],
    "apex.contrib.torchsched.inductor": [("patch_graph_lowering", "function", [("patch", True)])],
    "apex.contrib.torchsched.inductor.event": [
        ("CudaEventSym", "class", ["factory", "idx", "originate_stream_idx", ("ref_count", 0),
                                   ("materialized_event", None)]),
        ("CudaEventFactory", "class", []),
    ],
    "apex.contrib.torchsched.inductor.graph": [("patch_graph_lowering", "function", [("patch", True)])],
    "apex.contrib.torchsched.inductor.scheduler": [("MultiCudaStreamScheduler", "class", ["operations"])],
    "apex.contrib.torchsched.inductor.wrapper": [
        ("EnterDeviceContextManagerWithStreamInfoLine", "class", None),
        ("ExitDeviceContextManagerWithStreamInfoLine", "class", None),
        ("EnterCudaStreamContextLine", "class", ["wrapper", "stream_idx", "upstream_events",
                                                 "buffers_from_other_streams", "buffers_requiring_device_check"]),
        ("ExitCudaStreamContextLine", "class", None),
        ("MultiStreamWrapperCodegen", "class", []),
        # in the stored copy (00e4cad4) but not in the 6424da3b listing; checked as well
        ("RecordBuffFromSideStreams", "class", ["buffers", "buffers_requiring_device_check"]),
    ],
    "apex.contrib.torchsched.ops.layer_norm": [
        ("CuDNNManager", "class", []),
        ("get_cudnn_manager", "function", []),
        ("LayerNormGraphFactory", "class", None),
        ("layer_norm", "function", ["x", "normalized_shape", "weight", "bias", ("eps", 1e-05)]),
        ("layer_norm_fake", "function", ["x", "normalized_shape", "weight", "bias", ("eps", 1e-05)]),
        ("layer_norm_backward", "function", _LN_BWD),
        ("layer_norm_backward_fake", "function", _LN_BWD),
        ("layer_norm_setup_context", "function", ["ctx", "inputs", "output"]),
        ("layer_norm_backward_wrapper", "function", ["ctx", "d_y", "d_x_mean", "d_x_invstd"]),
    ],
    "apex.contrib.torchsched.passes": [("pre_grad_custom_pass", "function", ["graph"])],
    "apex.contrib.torchsched.passes.pre_grad_passes": [
        ("register_pattern", "function", ["name", "pattern", "replacement"]),
        ("replace_layer_norm", "function", ["x", "normalized_shape", "weight", "bias", "eps"]),
        ("run_pre_grad_pass", "function", ["name", "graph", "pattern", "replacement"]),
        ("pre_grad_custom_pass", "function", ["graph"]),
    ],
}

# Defaults recorded as "<...>" name an upstream object (an enum member, an Inductor function) that has no
# meaning to compare by value; the check only requires that the parameter has a default.
