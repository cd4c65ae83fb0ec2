"""Graph passes of the torchsched backend."""

from culmen.contrib.torchsched.passes.pre_grad_passes import pre_grad_custom_pass

__all__ = ["pre_grad_custom_pass"]
