"""Neural network modules of MCN: the parts (``branch.py``) named by the settings (``parts.py``'s
table), the audio CNN, the gated units and the three-branch model."""

from raymcn.model.mcn import MCN

__all__ = ["MCN"]
