"""Training: stage schedule, retrieval metrics, the Ray-free loop, checkpoints, and the Ray Train glue.

Only ``worker.py`` and ``launch.py`` import Ray.
"""
