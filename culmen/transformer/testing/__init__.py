"""``apex.transformer.testing``: what Apex's model-parallel tests import: the distributed unittest bases
(``distributed_test_base``), ``commons``, ``global_vars``, ``arguments`` and the standalone Megatron-style
models (``standalone_gpt``, ``standalone_bert``, built on ``standalone_transformer_lm``)."""
