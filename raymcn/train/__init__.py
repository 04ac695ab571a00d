"""Training. The run itself lives here, no Ray: its inputs (``inputs``) and plan (``plan``), the
assembly (``build``), the epoch loop (``loop``, ``feed``, ``gradcache``), stage orders, retrieval
metrics and fault injection. Around it, a room per concern: ``checkpoints/``, ``monitor/`` (what a
person sees), ``preflight/`` (checks and memory before the first step) and ``on_ray/``, the only
folder that imports Ray (the driver's TorchTrainer and the worker function).
"""
