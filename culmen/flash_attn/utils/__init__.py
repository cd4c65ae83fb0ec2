"""flash_attn's ``flash_attn.utils`` on culmen: ``distributed``, ``generation``, ``pretrained``, ``benchmark``."""
