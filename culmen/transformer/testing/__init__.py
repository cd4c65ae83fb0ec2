"""``apex.transformer.testing``: the helpers Apex's model-parallel tests import. So far the distributed
unittest bases (``distributed_test_base``); Apex's standalone GPT/BERT are not here yet."""
