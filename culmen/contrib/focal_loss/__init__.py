"""``apex.contrib.focal_loss``: the RetinaNet sigmoid focal loss.

As in Apex, ``from culmen.contrib.focal_loss import focal_loss`` gives the *module*
``culmen.contrib.focal_loss.focal_loss``, whose ``focal_loss`` function and ``FocalLoss.apply`` compute the loss.
"""

from culmen.contrib.focal_loss import focal_loss

__all__ = ["focal_loss"]
