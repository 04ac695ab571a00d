"""Ray Tune sweeps: each trial is a full Ray Train run (a Tune function that fits a TorchTrainer)."""
