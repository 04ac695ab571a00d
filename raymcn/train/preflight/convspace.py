"""The workspace the model's convolution kernels allocate and free, per kernel path (the
``conv_workspace`` term of ``footprint.py``'s estimate; measured per conv call by ``bench/step.py``).
The convolutions themselves are the model's, as its traced forward runs them
(``model_trace.py``). No Ray; torch only where :func:`conv_path` asks this machine which path it takes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class ConvShape:
    """One convolution per clip: channels, kernel area, and input/output positions."""

    cin: int
    cout: int
    kernel: int  # kh · kw
    positions_in: int  # H · W of the input
    positions_out: int  # H' · W' of the output
    stride: int = 1

    @property
    def weight(self) -> int:
        return self.cout * self.cin * self.kernel


# Kernel paths of the convolutions, each with its own workspace (see the module table).
ONEDNN_AVX512 = "onednn-avx512"  # x86 with AVX-512 (AMX machines run fp32 convs on these kernels)
ONEDNN_AVX2 = "onednn-avx2"  # x86 with AVX2 but not AVX-512
NATIVE = "native"  # oneDNN disabled or not built: im2col + GEMM
CUDNN = "cudnn"  # GPU: chosen at run time
UNKNOWN = "unknown"  # another CPU ISA (below AVX2) or architecture: no measured model
CONV_PATHS = (ONEDNN_AVX512, ONEDNN_AVX2, NATIVE, CUDNN, UNKNOWN)
MODELLED_CONV_PATHS = (ONEDNN_AVX512, ONEDNN_AVX2, NATIVE)
# Paths with no measured model borrow a margin from measured ones. cuDNN transforms layouts much as
# oneDNN reorders (a copy of the input and output, fp32-counted: twice their bf16 size) and torch
# falls back to an algorithm with a smaller workspace when an allocation fails; an unknown CPU ISA
# gets the larger of the AVX2 and im2col workspaces.
MARGIN_PATHS = {CUDNN: (ONEDNN_AVX512,), UNKNOWN: (ONEDNN_AVX2, NATIVE)}
_CHANNEL_BLOCK = {ONEDNN_AVX512: 1, ONEDNN_AVX2: 8}  # padding of channel blocks, measured per ISA


def conv_path(use_gpu: bool = False) -> str:
    """The convolution kernel path this machine's torch takes for the model's fp32 convolutions.

    oneDNN dispatches on the CPU's instruction set, capped by ``ONEDNN_MAX_CPU_ISA`` (or its old
    name ``DNNL_MAX_CPU_ISA``), which is also how a test or a user reproduces another machine's
    path. Imports torch (the estimate itself does not).
    """
    if use_gpu:
        return CUDNN
    import torch

    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return NATIVE
    level = instruction_level()
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap and not any(tag in cap for tag in ("AVX512", "AVX10", "AMX", "DEFAULT", "ALL")):
        level = min(level, 1 if cap.startswith("AVX2") else 0)
    return (UNKNOWN, ONEDNN_AVX2, ONEDNN_AVX512)[level]


def instruction_level() -> int:
    """The CPU's vector instructions oneDNN dispatches on: 0 below AVX2, 1 AVX2, 2 AVX-512 (and AMX,
    whose fp32 convolutions use it). The hardware's, as torch's CPU probe reports them (torch 2.4 and
    later: ``torch.cpu._is_avx512_supported``), else as Linux's ``/proc/cpuinfo`` flags do; not ATen's
    own choice (``torch.backends.cpu.get_cpu_capability()``), which ``ATEN_CPU_CAPABILITY`` lowers
    without changing oneDNN's."""
    import torch

    cpu = torch.cpu
    if hasattr(cpu, "_is_avx512_supported") and hasattr(cpu, "_is_avx2_supported"):
        return 2 if cpu._is_avx512_supported() else 1 if cpu._is_avx2_supported() else 0
    flags = cpuinfo_flags()
    return 2 if "avx512f" in flags else 1 if "avx2" in flags else 0


def cpuinfo_flags(text: str | None = None) -> set[str]:
    """The first processor's ``flags`` of ``/proc/cpuinfo`` (``text``: its contents; default read
    here); empty where there is no such file (not Linux)."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return set()
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == "flags"), "")
    return set(line.partition(":")[2].split())


def _padded(channels: int, block: int) -> int:
    return math.ceil(channels / block) * block


# oneDNN's scratchpad grows with the threads (per-thread reduction rows of the small convs):
# measured ≤ 11 KB per thread at 160 output positions with 1–32 threads; counted as two 16-float
# vectors per output position per thread, plus a fixed allowance per call for what blocking and
# scratchpad sizes may vary with the cache sizes and the oneDNN version (64 Ki floats = 256 KiB).
SCRATCH_ELEMENTS_PER_POSITION_THREAD = 32
ONEDNN_CALL_ALLOWANCE_ELEMENTS = 1 << 16


def _conv_call_elements(s: ConvShape, clips: int, path: str, threads: int) -> int:
    """fp32 elements one conv call (forward or backward) allocates and frees beyond its outputs."""
    if path == NATIVE:
        # im2col columns (the forward's and grad_input's alike); from 16 clips torch may take NNPACK,
        # measured below this bound
        return clips * s.cin * s.kernel * s.positions_out
    block = _CHANNEL_BLOCK[path]
    cin, cout = _padded(s.cin, block), _padded(s.cout, block)
    copies = 2 if s.stride > 1 else 1  # the strided convs' backward copies the input twice
    # weights, input, output, each reordered into the blocked layout (channels padded to the block)
    scratch = threads * SCRATCH_ELEMENTS_PER_POSITION_THREAD * s.positions_out + ONEDNN_CALL_ALLOWANCE_ELEMENTS
    return cout * cin * s.kernel + clips * (copies * cin * s.positions_in + cout * s.positions_out) + scratch


def conv_workspace_bytes(shapes: Sequence[ConvShape], clips: int, path: str, threads: int | None = None) -> int:
    """Bytes the largest of the convolution calls ``shapes`` (per clip, :class:`ConvShape`)
    allocates and frees on ``path`` with ``clips`` clips; 0 for a model without convolutions.

    ``threads``: intra-op threads of the worker (default: every CPU of this machine, an upper bound).

    Measured per conv call with torch's allocator (``bench/step.py``; forward and backward, paper
    and tiny dims): oneDNN AVX-512 and AVX2 and the native path stay at or below these formulas.
    ``cudnn`` and ``unknown`` have no measured model: they get the stated margin of
    :data:`MARGIN_PATHS` (:func:`conv_path_note` says so).
    """
    if path not in CONV_PATHS:
        raise ValueError(f"conv path {path!r}: expected one of {', '.join(CONV_PATHS)}")
    paths = MARGIN_PATHS.get(path, (path,))
    threads = threads or os.cpu_count() or 1
    return FP32 * max((_conv_call_elements(s, clips, p, threads) for s in shapes for p in paths), default=0)


def conv_path_note(path: str) -> str:
    """One line for the preflight: which conv workspace model the estimate used."""
    if path in (CUDNN, UNKNOWN):
        what = "cuDNN picks its algorithm at run time" if path == CUDNN else "no model for this CPU's ISA"
        borrowed = " and ".join(MARGIN_PATHS[path])
        return (f"conv workspace ({path}): not known in advance ({what}); the estimate reserves the largest "
                f"{borrowed} workspace as a margin")
    return f"conv workspace ({path}): measured model of this kernel path"
