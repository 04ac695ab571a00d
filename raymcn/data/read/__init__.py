"""Shards -> batches: the data order f(seed, epoch, step), the Ray-free stream, the Ray Data datasource."""
