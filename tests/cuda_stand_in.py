"""Stand-ins for a GPU machine on one without: :func:`fake_nvml` for NVML (``pynvml``), and
:class:`CudaRecorder`, a recording stand-in for ``torch.cuda``: every function and class of the
module (and the tensor methods that reach CUDA: ``pin_memory``, ``record_stream``, ``.to`` /
``.cuda`` to a CUDA device) is replaced by one that records the call (its name, the calling
thread, that thread's current device) and returns a stand-in value, so the GPU code paths run on
CPU and a test can read what they asked of CUDA and from which thread. ``torch.accelerator`` (torch
2.6 and later) is CUDA's, each of its calls the ``torch.cuda`` call it stands for: so a CPU build
and a CUDA build of torch take the same path through the stand-in on a machine without a GPU (a
CUDA build reaches CUDA through ``torch.accelerator`` too: an optimizer's step asks whether the
current stream captures a CUDA graph). Each stand-in keeps the name and ``__wrapped__`` of the
function it replaces: torch's own modules read them when imported (torch 2.15's Dynamo reads
``torch.cuda.use_mem_pool.__wrapped__``).

The current device is per thread, as in CUDA: ``set_device`` changes the calling thread's only,
and a thread that never set one is on device 0. ``is_initialized()`` turns true at the first call
that would initialise CUDA: anything but :data:`QUERIES`. Before that, the stand-in answers as
torch 2.x does: the allocator's statistics read 0 (``memory_allocated`` and its kind), and
resetting them (:data:`ALLOCATOR_RESETS`) raises torch's own ``RuntimeError``, which a fresh
process (a Ray task) meets when it resets them before setting its device.

:func:`on_host` lets a whole GPU code path run on a CPU-only torch: tensors asked for on a CUDA
device are made on the host, NCCL is gloo and DDP drops its device ids (CPU torch has none of
them); what reaches ``torch.cuda`` is still recorded and answered by :class:`CudaRecorder`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

# Calls that initialise nothing in torch: the availability queries, and the allocator's statistics,
# which read 0 (or {}) until CUDA is initialised; empty_cache does nothing until then.
QUERIES = frozenset({"is_available", "device_count", "is_initialized", "_is_compiled", "memory_allocated",
                     "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
                     "memory_stats_as_nested_dict", "empty_cache"})
# Initialise nothing either, but raise before CUDA is initialised (torch's C++ allocator checks the device)
ALLOCATOR_RESETS = frozenset({"reset_peak_memory_stats", "reset_accumulated_memory_stats"})
NOT_INITIALISED = "Invalid device argument : did you call init?"  # torch's own message


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple
    thread: str
    device: int  # the calling thread's current device when it called

    @property
    def initialises(self) -> bool:
        return self.name not in QUERIES and self.name not in ALLOCATOR_RESETS


class _Stream:
    def __init__(self, device=None, *args, **kwargs):
        self.device = device

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:  # a CUDA graph capture: never here
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def _index(device) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return 0 if device.index is None else device.index


class CudaRecorder:
    """Installs the stand-in with ``monkeypatch`` (undone after the test); ``calls`` lists every call."""

    def __init__(self, monkeypatch, devices: int = 4, free: int = 70 << 30, total: int = 80 << 30):
        self.devices, self.free, self.total = devices, free, total
        self.calls: list[Call] = []
        self._current: dict[int, int] = {}  # thread id -> its current device
        self._lock = threading.Lock()
        for name, value in list(vars(torch.cuda).items()):
            if name.startswith("__") or not (inspect.isfunction(value) or inspect.isbuiltin(value)
                                             or inspect.isclass(value)):
                continue
            if not getattr(value, "__module__", "").startswith("torch.cuda"):
                continue  # typing names, torch's storage and error types
            if inspect.isclass(value) and name not in ("Stream", "Event", "device", "StreamContext", "ExternalStream"):
                continue
            monkeypatch.setattr(torch.cuda, name, self._recording(name, value))
        monkeypatch.setattr(torch.Tensor, "pin_memory", self._tensor_method("Tensor.pin_memory", lambda t, *a, **k: t))
        monkeypatch.setattr(torch.Tensor, "record_stream", self._tensor_method("Tensor.record_stream",
                                                                               lambda t, *a, **k: None))
        monkeypatch.setattr(torch.Tensor, "cuda", self._tensor_method("Tensor.cuda", lambda t, *a, **k: t))
        to = torch.Tensor.to

        def to_device(t, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
                self._record("Tensor.to", (str(target),))
                return t  # stays on the host: only the call is of interest
            return to(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to_device)
        if hasattr(torch, "accelerator"):  # torch 2.6 and later
            self._accelerator(monkeypatch)

    def _accelerator(self, monkeypatch) -> None:
        """``torch.accelerator`` as a CUDA build on a GPU machine has it: CUDA is the accelerator, and
        each call is the ``torch.cuda`` call it stands for (so recorded, on the calling thread's
        device). A CUDA build reaches CUDA through it from Python (``Optimizer.step`` asks
        ``current_stream().is_capturing()``), which the stand-in of ``torch.cuda`` alone would leave to
        the real runtime: no driver on a CPU machine. A CPU build has no accelerator at all, so without
        this the two builds would take different paths through the same code."""
        aliases = {"current_device_index": "current_device", "current_device_idx": "current_device",
                   "set_device_index": "set_device", "set_device_idx": "set_device", "device_index": "device",
                   "get_memory_info": "mem_get_info", "Graph": "CUDAGraph"}
        for name, value in list(vars(torch.accelerator).items()):
            if name.startswith("_") or not getattr(value, "__module__", "").startswith("torch.accelerator"):
                continue  # what the module imported: functools, typing
            if name == "current_accelerator":  # a compile-time answer: CUDA, where it is available
                def value(check_available: bool = False):
                    return torch.device("cuda") if not check_available or torch.cuda.is_available() else None
            else:
                cuda_name = aliases.get(name, name)
                cuda = vars(torch.cuda).get(cuda_name)
                value = cuda if getattr(cuda, "__module__", "") == __name__ else self._recording(cuda_name, cuda)
            monkeypatch.setattr(torch.accelerator, name, value)

    # --- what a test reads -------------------------------------------------------------------
    def in_thread(self, thread: str) -> list[Call]:
        return [c for c in self.calls if c.thread == thread]

    def initialising(self) -> list[Call]:
        return [c for c in self.calls if c.initialises]

    # --- the stand-ins -------------------------------------------------------------------------
    def _device(self) -> int:
        return self._current.get(threading.get_ident(), 0)

    def _record(self, name: str, args: tuple) -> None:
        with self._lock:
            self.calls.append(Call(name, args, threading.current_thread().name, self._device()))

    def _tensor_method(self, name: str, result):
        def method(t, *args, **kwargs):
            self._record(name, args)
            return result(t, *args, **kwargs)
        return method

    def _recording(self, name: str, original=None):
        """A recording stand-in for ``torch.cuda.<name>`` (``original``: what it replaces). A function's
        stand-in carries the original's attributes and ``__wrapped__``: torch 2.15's Dynamo reads
        ``torch.cuda.use_mem_pool.__wrapped__`` at its import (the optimizer's step may import it). A
        class's is a subclass whose construction records and returns the stand-in object: still a class
        of torch's, as the Dynamo of torch before 2.5 checks at its import (DDP imports it) for
        ``Event`` and ``Stream``."""
        def call(*args, **kwargs):
            initialised = bool(self.initialising())
            self._record(name, args)
            if name in ALLOCATOR_RESETS and not initialised:
                raise RuntimeError(NOT_INITIALISED)
            return self._answer(name, args)
        if inspect.isclass(original):
            return type(name, (original,), {"__new__": lambda _cls, *args, **kwargs: call(*args, **kwargs)})
        if original is not None:  # its name and doc, its __dict__ (a context manager's __wrapped__), itself
            functools.update_wrapper(call, original, assigned=("__name__", "__qualname__", "__doc__"))
        return call

    def _answer(self, name: str, args: tuple):
        if name == "is_available":
            return self.devices > 0
        if name == "device_count":
            return self.devices
        if name == "is_initialized":
            return bool(self.initialising())
        if name == "set_device":
            self._current[threading.get_ident()] = _index(args[0])
            return None
        if name == "current_device":
            return self._device()
        if name == "is_bf16_supported":  # the lab's A100s, and every GPU since
            return True
        if name == "mem_get_info":
            return self.free, self.total
        if name in ("Stream", "current_stream", "default_stream", "ExternalStream"):
            return _Stream(*args)
        if name == "Event":
            return _Event(*args)
        if name in ("stream", "device", "StreamContext", "device_of"):
            return contextlib.nullcontext()
        if name in ("get_rng_state",):
            return torch.zeros(16, dtype=torch.uint8)
        if name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
            return 0
        if name in ("memory_stats", "memory_stats_as_nested_dict"):
            return {}
        return None


class _TensorsOnHost(TorchFunctionMode):
    """Every torch call asked to make a tensor on a CUDA device (``device=``) makes it on the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_host(monkeypatch):
    """A GPU code path on CPU torch (module doc), in the calling thread, with :class:`CudaRecorder`
    installed: CUDA tensors made on the host, NCCL groups made with gloo, DDP without device ids,
    CUDA's autocast the host's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        return init("gloo" if backend == "nccl" else backend, *args, **kwargs)

    class HostDDP(DistributedDataParallel):
        def __init__(self, module, device_ids=None, output_device=None, **kwargs):
            super().__init__(module, **kwargs)

    class HostAutocast(torch.autocast):  # CUDA's bf16 autocast as the host's: the same mixed precision
        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", HostDDP)
    monkeypatch.setattr(torch, "autocast", HostAutocast)
    with _TensorsOnHost():
        yield


def fake_nvml(gpus: list[tuple[int, int]], init_error: str = "") -> types.ModuleType:
    """A stand-in for ``pynvml`` that reports ``gpus`` as (free, total) bytes; [] = no driver (NVML's
    library not found). ``init_error``: the NVML error class ``nvmlInit`` raises instead, as
    pynvml names them (e.g. ``NVMLError_LibRmVersionMismatch``: a driver updated without a reboot)."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def error(name: str, message: str) -> NVMLError:
        return type(name, (NVMLError,), {})(message)

    def init() -> None:
        if init_error:
            raise error(init_error, "RM has detected an NVML/RM version mismatch.")
        if not gpus:
            raise error("NVMLError_LibraryNotFound", "NVML Shared Library Not Found")

    memory = [types.SimpleNamespace(free=free, total=total, used=total - free) for free, total in gpus]
    nvml.NVMLError = NVMLError
    nvml.nvmlInit, nvml.nvmlShutdown = init, lambda: None
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetUUID = lambda i: f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"
    nvml.nvmlDeviceGetMemoryInfo = lambda i: memory[i]
    return nvml
