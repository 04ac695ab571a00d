"""Data: the original per-video feature layout, words, the synthetic corpus, eval sets, shards.

Only ``reader.py`` imports Ray.
"""
