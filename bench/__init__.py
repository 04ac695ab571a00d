"""raymcn's benchmarks, one module each, run from the repository's root as modules:
``python -m bench.loader --help``.

Every benchmark runs under one harness (:mod:`bench.harness`): the same ``--smoke``, ``--json`` and
``--out`` arguments, the machine line beside its figures, and its figures saved as each
measurement finishes. The helpers the benchmarks and the tests share live here too (gloo ranks in
:mod:`bench.gloo`, local servers and Ray's multi-node test cluster in :mod:`bench.services`); the
tests import them from here, and nothing here imports the tests.
"""
