"""Neural network modules of MCN: the audio CNN, the gated units and the three-branch model."""

from raymcn.model.mcn import MCN

__all__ = ["MCN"]
