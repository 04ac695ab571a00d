"""This machine's GPUs and their free memory, read through NVML: no CUDA context, no torch.

The driver (``raymcn train`` and ``raymcn sweep`` before Ray starts, and the process that then
runs ``trainer.fit`` or the whole sweep) must not open a CUDA context: on the lab's head, which
also runs trials, a context costs every GPU it touches about 0.5 GiB for the driver's whole life.
``torch.cuda.mem_get_info(i)`` creates one on GPU i; NVML (the library behind ``nvidia-smi``, here
through ``nvidia-ml-py``) reads the same numbers from the driver without one. NVML sees every GPU of
the machine; :func:`visible_gpus` keeps those ``CUDA_VISIBLE_DEVICES`` names (by index or UUID),
as CUDA would (an index counts in PCI bus order, which is CUDA's own on a server of identical GPUs,
and on any with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``). A machine without the NVIDIA driver (NVML's
library missing, or the kernel driver not loaded) has no GPU; any other NVML failure (a driver
and library of different versions after an update, a GPU lost) is raised as :class:`GpuQueryError`
with NVML's own words, never taken for "no GPU".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from raymcn.config import reason

# NVML's errors that mean "no NVIDIA driver here": a CPU machine, not a broken GPU one
NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")


class GpuQueryError(RuntimeError):
    """NVML is there but failed: the GPUs could not be read (the message says NVML's error)."""


@dataclass(frozen=True)
class GpuMemory:
    """One GPU as NVML sees it: its NVML index (PCI bus order, as ``nvidia-smi`` numbers them),
    UUID, and free and total bytes (free: what no process, this one included, holds)."""

    index: int
    uuid: str
    free: int
    total: int


def visible_gpus() -> list[GpuMemory]:
    """Every GPU this process may use (``CUDA_VISIBLE_DEVICES``, when set), with its free memory;
    [] when there is no NVIDIA driver (module doc).

    Raises:
        GpuQueryError: nvidia-ml-py cannot be imported, or NVML failed otherwise (its error named).
    """
    try:
        import pynvml
    except ImportError as e:  # a dependency: missing means a broken install, not a machine without GPUs
        raise GpuQueryError(f"nvidia-ml-py (pynvml) does not import ({reason(e)}): reinstall raymcn") from e
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if type(e).__name__ in NO_DRIVER:
            return []
        raise GpuQueryError(f"NVML could not start: {reason(e)}") from e
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuMemory(i, uuid.decode() if isinstance(uuid, bytes) else str(uuid), int(memory.free),
                                  int(memory.total)))
    except pynvml.NVMLError as e:
        raise GpuQueryError(f"NVML could not read the GPUs: {reason(e)}") from e
    finally:
        pynvml.nvmlShutdown()
    return _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _visible(gpus: list[GpuMemory], spec: str | None) -> list[GpuMemory]:
    """The GPUs ``CUDA_VISIBLE_DEVICES=spec`` leaves visible (None: all). Entries are indices or
    UUIDs (``GPU-...``, a unique prefix is enough); CUDA stops at the first one that names no GPU."""
    if spec is None:
        return gpus
    out: list[GpuMemory] = []
    for entry in (e.strip() for e in spec.split(",")):
        found = None
        if entry.isdigit():
            found = next((g for g in gpus if g.index == int(entry)), None)
        elif entry:
            found = next((g for g in gpus if g.uuid.startswith(entry)), None)
        if found is None or found in out:
            break
        out.append(found)
    return out
