"""Services a benchmark or a test starts on this machine: a free port, Ray's multi-node test cluster,
an S3-compatible server (moto's server mode)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

NODE_STORE = 150 * 1024**2  # object store per node of the multi-node test cluster
MOTO = Path(sys.executable).with_name("moto_server")  # installed by the test extras (moto[server])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking): raymcn's own
    (``on_ray/cluster.free_port``, imported on use: that module imports Ray)."""
    from raymcn.train.on_ray.cluster import free_port as free

    return free()


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    """Until something accepts connections on ``port`` of 127.0.0.1; RuntimeError naming ``what``
    if ``proc`` ends or ``timeout_s`` passes first."""
    deadline = time.time() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


class MultinodeCluster:
    """Ray's multi-node test cluster on this machine, this driver connected, that can also go down
    whole and come back (:meth:`reboot`); every other attribute is the running
    ``ray.cluster_utils.Cluster``'s.

    The head (this driver's node) takes no work (``num_cpus=0``): Ray refuses to remove it. Then one
    raylet per entry of ``nodes`` (``add_node`` arguments). The dashboard, which Ray's state API
    needs, listens on a free port: another Ray on this machine may hold the default one.
    """

    def __init__(self, nodes: tuple[dict, ...]):
        self.nodes = nodes
        self.cluster = None
        self._before = os.environ.get("RAY_API_SERVER_ADDRESS")

    def __getattr__(self, name: str):
        if name == "cluster":  # not set yet
            raise AttributeError(name)
        return getattr(self.cluster, name)

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            ray.shutdown()
        port = free_port()
        # pinned as raymcn pins its local instances (on_ray/cluster.py): every raylet and the driver
        # ask this cluster's State API, whatever other Ray instance runs on the machine
        pinned = {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
        os.environ.update(pinned)  # read by every raylet of the cluster at its start, and by this driver
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": True, "dashboard_port": port, "object_store_memory": NODE_STORE})
        for node in self.nodes:
            self.cluster.add_node(**{"object_store_memory": NODE_STORE, **node})
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False, runtime_env={"env_vars": pinned})

    def stop(self) -> None:
        import ray

        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None

    def reboot(self) -> None:
        """Every process of the cluster ended (the head's reboot: its GCS gone, every raylet with it),
        then the same cluster started again: a new head (a new address) and the same raylets."""
        self.stop()
        self.start()

    def restore_environment(self) -> None:
        if self._before is None:
            os.environ.pop("RAY_API_SERVER_ADDRESS", None)
        else:
            os.environ["RAY_API_SERVER_ADDRESS"] = self._before


@contextlib.contextmanager
def multinode_cluster(*nodes: dict) -> Iterator[MultinodeCluster]:
    """A started :class:`MultinodeCluster` of ``nodes``; shut down on exit."""
    c = MultinodeCluster(nodes)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        c.restore_environment()


@contextlib.contextmanager
def s3_server(bucket: str) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 with one empty ``bucket``; yields its URI (``s3://bucket``).

    The usual AWS variables (endpoint, credentials, region) point at it while the block runs, in
    this process and in the processes it starts (Ray's: start Ray inside the block); they are
    restored after, and the server stopped. FileNotFoundError without moto's server."""
    if not MOTO.exists():
        raise FileNotFoundError(f"{MOTO} not found: pip install 'moto[server]' (in the test extras)")
    port = free_port()
    proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "raymcn",
           "AWS_SECRET_ACCESS_KEY": "raymcn", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        wait_for_port(port, proc, "moto_server")
        import boto3

        boto3.client("s3").create_bucket(Bucket=bucket)
        yield f"s3://{bucket}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def empty_bucket(uri: str) -> None:
    """Delete every object of the bucket ``s3://NAME``: moto keeps them in memory."""
    import boto3

    boto3.resource("s3").Bucket(uri.removeprefix("s3://").split("/")[0]).objects.all().delete()
