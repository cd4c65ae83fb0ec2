"""flash_attn's ``modules``: ``mha`` (``MHA``, ``ParallelMHA``, the inner attention modules), ``mlp`` (``Mlp``,
``GatedMlp`` and their parallel forms), ``block`` (``Block``, ``ParallelBlock``) and ``embedding``."""
