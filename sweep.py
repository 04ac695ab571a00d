"""Run a raymcn sweep: `python sweep.py` (embedded default, local Ray, synthetic data) or, on a
cluster, `ray submit cluster.yaml sweep.py -- --config sweeps/stage_order_bohb.yaml`.

Same as `raymcn sweep ...`. On a cluster head `ray.init()` finds the running cluster by itself.
"""

import sys

from raymcn.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
