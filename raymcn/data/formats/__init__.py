"""What the bytes are: tar headers, the per-video sample codec, words and vectors, the original feature layout,
the shard manifest, and the batch contract a step reads."""
