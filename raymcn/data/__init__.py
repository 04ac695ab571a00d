"""Data: the original per-video feature layout, words, the synthetic corpus, eval sets, shards.

The shard path, each module importing only those before it: ``tarfmt`` (tar and .npy bytes) ->
``sample`` (one video's members, checks, decoding) -> ``shards`` (writer, manifest) and ``stream``
(shard files -> records -> per-rank batches, no Ray) -> ``reader`` (Ray Data), the only module of
this package that imports Ray. ``synthetic`` writes the default corpus and its shards.
"""
