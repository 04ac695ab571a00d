"""``raymcn doctor``: every node of the cluster checked before a sweep spends GPU-hours, and the
sweep's duration estimated before it starts.

The head resolves the config's inputs (``train/inputs.py``) and sends every node, the head
included, one probe task pinned to it by its node id (``probe.probe``; it reserves no CPU or GPU, so
it also runs beside a sweep that holds every GPU). A probe only gathers facts; the head judges
them (``verdicts.judge``, pure, so a test can hand it facts one machine cannot produce) and prints a
table: a row per check, a column per node, ✔ or ✘ (– where a check does not apply), and under it,
for each ✘, the fix in one line. ``--step`` also runs one real training step of the config on one
GPU (or CPU) of each node (``train/preflight/step_probe.py``, what ``bench/gpu_smoke.py`` runs);
that probe needs a free GPU and waits for one at most ``--step-timeout`` seconds.

The duration (``estimate.estimate``): from the step time (``--step``'s, or ``--step-time``) and the
config's steps per epoch, epochs, trials, concurrency, early-stopping rungs and confirmation runs,
the sweep's GPU-hours and wall time, as a range for what early stopping may cut. An estimate: it
leaves out what no node can measure in advance (restarts, a slower disk under load).

The check itself, run on the head, is ``checkup.py``.
"""
