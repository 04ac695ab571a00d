"""What made a run's numbers, kept beside them: the provenance record of every run and sweep folder.

``collect`` (what a process can say about itself: the code, the packages, the machine, a file's
identity; stdlib only), ``record`` (the record file: its entries, appended, never rewritten),
``describe`` (entries as labels, facets and the trackers' forms) and ``compare`` (what differs
between two entries, or between the nodes of one run). Left of the data layer: it imports only
the config's names and ``storage``; the run's side (``train/run_record.py``) builds the entries,
and the results tables read them (``results/origins.py``) without Ray or torch.
"""
