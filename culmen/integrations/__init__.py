"""Integrations with other libraries. Importing this package imports none of them.

* :mod:`culmen.integrations.huggingface`: ``attn_implementation="culmen"`` for ``transformers`` models and
  ``patch(model)``, which swaps culmen's fused norms, rotary, MLP activations and fused linear +
  cross-entropy loss into a model in place.
"""
