"""What a checkpoint holds and how a run continues from one: payloads, start-from weights, the original release's importer."""
