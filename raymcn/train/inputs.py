"""The files a run reads, resolved once by the entry point: the first step of every run and sweep.

``raymcn train``, ``raymcn sweep``, ``launch.fit`` and the benchmarks call :func:`resolve_inputs`
once, on the driver, before anything else: the config's ``data.shards``, ``data.eval_set`` and
``data.word_vectors`` become absolute paths, and the embedded default (no ``data.shards``, the
``synthetic`` eval set) is generated into the cache here and named by its paths. From then on
nothing distinguishes the default from the lab's data: the plan (``run_plan.py``), the preflight, the
trainer, every sweep trial and every rank receive these paths and only read them. No other step
writes data; ``tests/test_flow.py`` checks that.

The paths must mean the same files on every node that runs a trial or a rank: the lab's shards
and eval pickles on shared storage, and for the embedded default the cache (``RAYMCN_CACHE``),
which a multi-node cluster keeps on shared storage too (``cluster.yaml``). ``raymcn doctor``
checks them on every node before a sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raymcn.config import Config, ConfigError
from raymcn.data.evalsets import SYNTHETIC_FRAMES, EvalSet, load_eval_set, parse_eval_spec
from raymcn.data.formats.manifest import feature_dtype, load_manifest
from raymcn.data.formats.words import load_vocab
from raymcn.data.read.order import VideoIndex, build_index


@dataclass(frozen=True)
class RunInputs:
    """What a run reads, every path absolute (see the module doc).

    Attributes:
        shards_dir: the shard folder (shards, ``vocab.npy``, ``manifest.json``).
        index: where every video of the shards lies (``order.VideoIndex``); its length is the
            number of videos a run trains on.
        shard_bytes: each shard's size as the manifest records it, in ``index.shard_names`` order.
        feature_dtype: the 2d/3d features' dtype in the shards.
        eval_set: ``youcook:FILE`` or ``msrvtt:FILE`` (the synthetic held-out set is a YouCook2-style
            pickle of the cached corpus).
        eval_audio_frames: the eval set's audio length T (0: the set's own, 5120 or 3072).
        word_vectors: the word2vec file for the eval captions; "" = the shards' ``vocab.npy``.
    """

    shards_dir: str
    index: VideoIndex
    shard_bytes: tuple[int, ...]
    feature_dtype: str
    eval_set: str
    eval_audio_frames: int
    word_vectors: str

    @property
    def videos(self) -> int:
        return len(self.index)


# The settings that decide a run's inputs: a sweep reads one corpus and one eval set for all its trials.
INPUT_KEYS = ("data.shards", "data.eval_set", "data.word_vectors", "data.eval_audio_frames", "data.cache_dir",
              "data.synthetic_videos", "data.synthetic_eval_clips", "data.synthetic_topics", "model.word_dim")


def resolve_inputs(cfg: Config) -> RunInputs:
    """The inputs of ``cfg``, the embedded default generated into the cache when asked for.

    Raises:
        ConfigError: the shard folder, its manifest or the eval file is missing or unreadable
            (naming the setting and the path).
    """
    folder = shard_folder(cfg)
    manifest, dtype = shard_manifest(cfg, folder)
    eval_set, frames, words = eval_inputs(cfg)
    return RunInputs(shards_dir=str(folder), index=build_index(folder, manifest),
                     shard_bytes=tuple(int(s["bytes"]) for s in manifest["shards"]), feature_dtype=dtype,
                     eval_set=eval_set, eval_audio_frames=frames, word_vectors=words)


def shard_manifest(cfg: Config, folder: Path) -> tuple[dict, str]:
    """(the manifest, the features' one dtype) of the shard folder ``folder`` (``cfg``'s).

    Raises:
        ConfigError: the folder does not exist, or its manifest is missing, unreadable or mixes dtypes.
    """
    where = f"data.shards={cfg.data.shards!r}"
    if not folder.is_dir():
        raise ConfigError([f"{where}: directory does not exist (write the shards there with "
                           f"`raymcn shards --out {cfg.data.shards} ...` from the feature folders or tars)"])
    try:
        manifest = load_manifest(folder)
        return manifest, feature_dtype(manifest, folder)  # one dtype in the folder, or the shards of each named
    except (OSError, ValueError) as e:
        raise ConfigError([f"{where}: {e}"]) from None


def shard_folder(cfg: Config) -> Path:
    """``data.shards`` made absolute, or the embedded default's shards (generated into the cache once)."""
    if cfg.data.shards:
        return Path(cfg.data.shards).expanduser().resolve()
    from raymcn.data import synthetic

    return synthetic.ensure_synthetic_shards(cfg)


def eval_inputs(cfg: Config) -> tuple[str, int, str]:
    """(eval set spec with an absolute file, its audio frames, the eval captions' word vectors)."""
    try:
        kind, file = parse_eval_spec(cfg.data.eval_set)
    except ValueError as e:
        raise ConfigError([f"data.eval_set: {e}"]) from None
    if kind == "synthetic":
        from raymcn.data import synthetic

        corpus = synthetic.CorpusPaths(synthetic.ensure_corpus(cfg))
        words = _absolute(cfg.data.word_vectors) if cfg.data.word_vectors else str(corpus.word_vectors)
        return f"youcook:{corpus.youcook_eval}", cfg.data.eval_audio_frames or SYNTHETIC_FRAMES, words
    words = _absolute(cfg.data.word_vectors) if cfg.data.word_vectors else ""
    return f"{kind}:{_absolute(file)}", cfg.data.eval_audio_frames, words


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def eval_set_of(cfg: Config) -> EvalSet:
    """The eval set of ``cfg``, loaded: for the entry points that evaluate without a plan
    (``raymcn eval``, benchmarks that train in memory). The embedded default's is generated once."""
    spec, frames, words = eval_inputs(cfg)
    return load_eval_set(spec, word_vectors=words or load_vocab(shard_folder(cfg)), max_words=cfg.data.max_words,
                         audio_frames_override=frames)
