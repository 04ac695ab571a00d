"""The Ray side of a run: the driver (TorchTrainer, cluster checks) and the worker function every rank runs."""
