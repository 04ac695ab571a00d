"""The model's own account of its memory, read from the built module: the preflight's memory
estimate (``footprint.py``) takes every model term from here, so a new part is estimated as it is.

The run's model (``MCN(cfg.model)``, its parts as the settings name them) is built on the meta
device: parameters and buffers have shapes and dtypes but no memory, and no arithmetic runs. Then
one forward of every branch and head at the run's shapes and dtypes (``data/formats/batch``'s
arrays, on meta tensors) runs under torch's saved-tensor hooks, which see every tensor autograd
keeps for the backward; a dispatch mode records every convolution's shapes. What one trace gives:

* parameters, buffers, the largest parameter (the optimizer's terms);
* the bytes a forward saves, distinct storages, parameters, buffers and the batch left out:
  exactly what autograd saves on CPU (fp32). On a GPU run (bf16 autocast) the same tensors are
  counted at the dtype CUDA's autocast gives them (:func:`_gpu_bytes`): a CPU build of torch
  cannot run CUDA's autocast, and the driver, which runs this before Ray starts, opens no CUDA
  context;
* the embeddings' width and dtype, and the reconstruction targets' widths (those that receive
  gradient apart), which the loss terms of the estimate need;
* every convolution's per-clip shapes, for the workspace of ``convspace.py``.

A forward's saved bytes are a line in the clips (per-clip tensors plus per-step ones such as
BatchNorm's statistics): two traces give the line, and the first size asked for is traced too and
must lie on it, or every size asked for is traced.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from raymcn.config import MODALITIES, Config, DataConfig, ModelConfig
from raymcn.data.formats.batch import batch_arrays
from raymcn.model import MCN
from raymcn.model.parts import text_in_bf16
from raymcn.model.syncbn import global_batchnorm
from raymcn.train.preflight.convspace import ConvShape

LINE_CLIPS = (2, 4)  # the two traces that give the line of saved bytes over clips

# CUDA's autocast (torch's "Autocast Op Reference": the ops CUDA autocasts to a lower precision, and
# those it autocasts to float32), by the op name of the autograd node that saves a tensor
# ("AddmmBackward0" -> addmm). Every other op keeps the dtype of its inputs (the widest, if they differ).
CUDA_LOWER_PRECISION = frozenset({
    "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "conv_tbc",
    "convolution", "cudnn_convolution", "mm", "mv", "matmul", "linear", "prelu", "einsum", "linalg_vecdot",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})
CUDA_FLOAT32 = frozenset({
    "pow", "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "softplus", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "norm",
    "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "cdist",
    "pdist", "dist", "renorm", "logsumexp", "prod", "cumprod", "cumsum", "sum", "softmax", "log_softmax",
    "binary_cross_entropy_with_logits", "cross_entropy", "nll_loss", "nll_loss2d", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "hinge_embedding_loss", "cosine_embedding_loss", "poisson_nll_loss"})
_FLOAT32, _BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class TraceKey:
    """What a trace depends on: the model's settings, the per-clip input shapes, the device kind."""

    model: ModelConfig
    audio_frames: int
    max_words: int
    gpu: bool

    @classmethod
    def of(cls, cfg: Config) -> TraceKey:
        return cls(cfg.model, cfg.data.audio_frames, cfg.data.max_words, bool(cfg.scale.use_gpu))


@dataclass(frozen=True)
class Forward:
    """One traced forward at ``clips`` clips: the bytes it saves for the backward, what it returns."""

    clips: int
    saved_bytes: int
    embed_dim: int
    embed_itemsize: int
    recon_width: int  # F: the reconstruction targets' widths, summed over the modalities
    recon_live_width: int  # F_live: those of the targets that carry gradient (not the batch's own)
    convs: tuple[ConvShape, ...]


@dataclass
class ModelTrace:
    """The run's model as the estimate reads it (module doc). Build it with :func:`trace_of`.

    Attributes:
        parameters: elements of every parameter; float_buffers: of every float buffer (BatchNorm's
            running statistics); state_bytes: bytes of both and of every other buffer (BatchNorm's
            int64 counters); largest_parameter: elements of the largest parameter.
        embed_dim, embed_itemsize, recon_width, recon_live_width, convs: as :class:`Forward`.
    """

    key: TraceKey
    parameters: int
    float_buffers: int
    state_bytes: int
    largest_parameter: int
    first: Forward
    second: Forward
    _exact: dict[int, int] = field(default_factory=dict)  # clips -> saved bytes, traced
    _line_checked: bool = False

    @property
    def embed_dim(self) -> int:
        return self.first.embed_dim

    @property
    def embed_itemsize(self) -> int:
        return self.first.embed_itemsize

    @property
    def recon_width(self) -> int:
        return self.first.recon_width

    @property
    def recon_live_width(self) -> int:
        return self.first.recon_live_width

    @property
    def convs(self) -> tuple[ConvShape, ...]:
        return self.first.convs

    def line(self) -> tuple[int, int]:
        """(bytes a forward saves whatever its clips, e.g. BatchNorm's statistics; bytes per clip),
        from the two traces (:data:`LINE_CLIPS`); the per-clip figure rounded down."""
        a, b = self.first, self.second
        per_clip = (b.saved_bytes - a.saved_bytes) // (b.clips - a.clips)
        return a.saved_bytes - per_clip * a.clips, per_clip

    def saved_bytes(self, clips: int) -> int:
        """Bytes one forward of ``clips`` clips saves for its backward (module doc: the line, checked
        once at the first size asked for; traced at every size if it is off the line)."""
        a, b = self.first, self.second
        rest = (b.saved_bytes - a.saved_bytes) % (b.clips - a.clips)
        fixed, per_clip = self.line()
        line = fixed + per_clip * clips
        if rest == 0 and self._line_checked:
            return line
        if clips not in self._exact:
            self._exact[clips] = _forward(self.key, clips).saved_bytes
        if rest == 0 and not self._line_checked and self._exact[clips] == line:
            self._line_checked = True
        return self._exact[clips]


@functools.lru_cache(maxsize=16)
def trace_of(key: TraceKey) -> ModelTrace:
    """The model of ``key`` traced (module doc), once per process and key."""
    net = _meta_model(key)
    params = list(net.parameters())
    buffers = list(net.buffers())
    return ModelTrace(
        key=key, parameters=sum(p.numel() for p in params),
        float_buffers=sum(b.numel() for b in buffers if b.is_floating_point()),
        state_bytes=sum(t.numel() * t.element_size() for t in params + buffers),
        largest_parameter=max(p.numel() for p in params),
        first=_forward(key, LINE_CLIPS[0]), second=_forward(key, LINE_CLIPS[1]))


def _meta_model(key: TraceKey) -> torch.nn.Module:
    """The run's model on the meta device, as a rank builds it: its parts, and on CPU the global
    BatchNorm of ``model.sync_batchnorm`` (on GPUs torch's SyncBatchNorm saves what BatchNorm does)."""
    with torch.device("meta"):
        net = MCN(key.model)
    if key.model.sync_batchnorm and not key.gpu:
        net = global_batchnorm(net, "cpu")
    return net


class _Ops(TorchDispatchMode):
    """Every op the forward runs, below autograd: each convolution's per-clip shapes (what
    ``convspace.py`` reads), and with ``gpu`` the dtype each output would have under CUDA's bf16
    autocast. That dtype is torch's own answer: the op is run again on meta stand-ins of its inputs
    in the dtypes they would have, cast first as CUDA's autocast casts that op (:func:`_policy`)."""

    def __init__(self, gpu: bool):
        super().__init__()
        self.gpu = gpu
        self.convs: list[ConvShape] = []
        self.dtype: dict[int, torch.dtype] = {}  # storage -> its dtype under CUDA's autocast

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.convolution.default:
            x, w, stride = args[0], args[1], args[3]
            self.convs.append(ConvShape(cin=x.shape[1], cout=w.shape[0], kernel=_prod(w.shape[2:]),
                                        positions_in=_prod(x.shape[2:]), positions_out=_prod(out.shape[2:]),
                                        stride=max(stride)))
        if self.gpu:
            self._autocast_dtypes(func, args, kwargs, out)
        return out

    def _autocast_dtypes(self, func, args, kwargs, out) -> None:
        cast = _policy(func.__name__.split(".")[0])

        def stand_in(x):
            if not isinstance(x, torch.Tensor):
                return x
            dtype = self.dtype.get(_storage(x), x.dtype)
            if cast is not None and x.is_floating_point():
                dtype = cast
            return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device="meta")

        try:
            mirrored = func(*pytree.tree_map(stand_in, args), **pytree.tree_map(stand_in, kwargs))
        except (RuntimeError, TypeError, NotImplementedError):
            return  # the op refuses these dtypes: its outputs keep their traced (fp32) dtype, the larger
        for real, twin in zip(pytree.tree_leaves(out), pytree.tree_leaves(mirrored)):
            if isinstance(real, torch.Tensor) and isinstance(twin, torch.Tensor):
                self.dtype[_storage(real)] = twin.dtype


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # one id per storage, also on the meta device (data pointers are 0)


def _forward(key: TraceKey, clips: int) -> Forward:
    """One forward of the model of ``key`` on ``clips`` clips, every branch and head active, traced."""
    net = _meta_model(key)
    cfg = Config(model=key.model, data=DataConfig(audio_frames=key.audio_frames, max_words=key.max_words))
    bf16 = text_in_bf16(key.model, key.gpu)
    batch = {k: torch.empty(shape, dtype=dtype, device="meta")
             for k, (shape, dtype) in batch_arrays(cfg, clips, bf16).items()}
    state = {_storage(t) for t in [*net.parameters(), *net.buffers()]}
    excluded = state | {_storage(t) for t in batch.values()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage(t) not in excluded:
            saved.setdefault(_storage(t), t)
        return t

    ops = _Ops(key.gpu)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops:
            out = net(batch, MODALITIES)
    except Exception as e:  # re-raised with what was traced and how, the cause chained
        raise RuntimeError(f"the memory estimate runs the model's forward on the meta device (no data, no memory) "
                           f"and it failed there ({type(e).__name__}: {e}); a part's forward must not read tensor "
                           f"values (.item(), data-dependent shapes): {_parts(key.model)}") from e
    embedding = out[MODALITIES[0]]
    targets = [out[f"recon_{m}"][1] for m in MODALITIES if f"recon_{m}" in out]
    if key.gpu:
        total = _gpu_bytes(out, state, excluded, saved, ops.dtype)
        itemsize = ops.dtype.get(_storage(embedding), embedding.dtype).itemsize
    else:
        total = sum(t.untyped_storage().nbytes() for t in saved.values())
        itemsize = embedding.element_size()
    return Forward(clips=clips, saved_bytes=total, embed_dim=int(embedding.shape[-1]), embed_itemsize=itemsize,
                   recon_width=sum(int(t.shape[-1]) for t in targets),
                   recon_live_width=sum(int(t.shape[-1]) for t in targets if t.requires_grad),
                   convs=tuple(dict.fromkeys(ops.convs)))


def _parts(model: ModelConfig) -> str:
    from raymcn.model.parts import PARTS

    return ", ".join(f"model.{s}={getattr(model, s)}" for s in PARTS)


def _node_op(node) -> str:
    """The op an autograd node differentiates: ``NativeLayerNormBackward0`` -> ``native_layer_norm``."""
    name = re.sub(r"Backward\d*$", "", type(node).__name__)
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _policy(op: str) -> torch.dtype | None:
    """The dtype CUDA's autocast runs op ``op`` in (an aten name, ``_softmax`` as ``softmax``), or
    None: the op keeps its inputs' dtypes."""
    op = op.lstrip("_")
    if op in CUDA_LOWER_PRECISION or op.startswith("scaled_dot_product"):
        return _BF16
    return _FLOAT32 if op in CUDA_FLOAT32 else None


def _gpu_bytes(out: dict, state: set[int], excluded: set[int], saved: dict[int, torch.Tensor],
               dtypes: dict[int, torch.dtype]) -> int:
    """What the traced forward's saved tensors take under CUDA's bf16 autocast.

    Each tensor an autograd node saves counts at the dtype of that node's op when CUDA's autocast
    runs the op in one (bf16 for matrix products and convolutions, fp32 for LayerNorm, softmax,
    sums ...: :data:`CUDA_LOWER_PRECISION`, :data:`CUDA_FLOAT32`), as a copy of its own when the
    tensor was made in another dtype (autocast's cast, a new tensor: the cast of a parameter or
    buffer, ``state``, is the estimate's ``autocast_weights``, the batch's counts here); otherwise
    at the dtype it was made in (``dtypes``, from :class:`_Ops`); ``excluded`` (the state and the
    batch) is not counted as made. Integer tensors keep their size. A saved tensor the walk
    over the graph does not reach counts at its traced (fp32) size."""
    counted: dict[tuple, int] = {}
    stack = [t.grad_fn for v in out.values() for t in (v if isinstance(v, tuple) else (v,)) if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
        cast = _policy(_node_op(node))
        for t in _saved_by(node):
            made = dtypes.get(_storage(t), t.dtype)
            if t.is_floating_point() and cast is not None and cast != made:
                if _storage(t) not in state:  # a weight's cast is autocast_weights
                    counted[(_storage(t), cast, node)] = t.numel() * cast.itemsize
            elif _storage(t) not in excluded:
                counted[(_storage(t), made, None)] = t.untyped_storage().nbytes() // t.element_size() * made.itemsize
    walked = {key[0] for key in counted}
    return sum(counted.values()) + sum(t.untyped_storage().nbytes() for s, t in saved.items() if s not in walked)


def _saved_by(node) -> list[torch.Tensor]:
    """The tensors autograd ``node`` saved (its ``_saved_*`` attributes; a custom Function's
    ``saved_tensors``)."""
    found = []
    for name in dir(node):
        if name.startswith("_saved_") or name == "saved_tensors":
            value = getattr(node, name)
            values = value if isinstance(value, (tuple, list)) else (value,)
            found += [v for v in values if isinstance(v, torch.Tensor)]
    return found
