"""Apex's compiled extension ``_apex_gpu_direct_storage``: its ``_GDSFile`` class is culmen's ``GDSFile``."""

from culmen.contrib.gpu_direct_storage import GDSFile as _GDSFile

__all__ = ["_GDSFile"]
