"""Features -> shards: the conversion plan, the writers (local processes or Ray actors), resume, the lab's tars as input."""
