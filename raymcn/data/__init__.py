"""Data: what the bytes are, how shards are written and read, and the corpora.

``formats/`` (tar headers, the per-video sample and its checks, words and vectors, the original
feature layout, the manifest) comes first; ``write/`` (features -> shards) and ``read/`` (shards ->
each rank's batches) use it; ``synthetic`` (the embedded default corpus) and ``evalsets`` (the
retrieval pickles) sit on top. Ray is imported only by ``read/datasource`` and ``write/ray_writers``.
"""
