"""What a person sees: the console, in-epoch progress, the watchdog that names stalls, trackers, metrics.csv;
and the benchmarks' event timeline."""
