"""``flash_attn.layers``: the rotary embedding layers (``culmen.flash_attn.layers.rotary``)."""
