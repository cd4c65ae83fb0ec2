"""``flash_attn.losses``: ``cross_entropy.CrossEntropyLoss`` (and culmen's ``FusedLinearCrossEntropyLoss``)."""
