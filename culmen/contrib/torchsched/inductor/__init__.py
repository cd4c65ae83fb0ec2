"""``apex.contrib.torchsched.inductor``: Apex's Inductor-level pieces of the multi-stream scheduler.

culmen schedules streams one level up, on the AOTAutograd graph (``culmen.contrib.torchsched.scheduler``), so
the Inductor patches here are names that point there: ``patch_graph_lowering(True)`` and the code-generator
classes raise ``NotImplementedError`` naming what to use. ``event.CudaEventSym`` / ``CudaEventFactory`` (the
symbolic event bookkeeping) work on their own.
"""

from culmen.contrib.torchsched.inductor.graph import patch_graph_lowering

__all__ = ["patch_graph_lowering"]
