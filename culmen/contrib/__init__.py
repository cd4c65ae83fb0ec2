"""``apex.contrib``: extensions outside Apex's core API. Subpackages are imported on demand
(``culmen.contrib.layer_norm`` ...), so importing this package loads nothing else."""
