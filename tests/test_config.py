"""Config: YAML + dotted overrides, typing, and checks that fail before Ray starts."""

import pytest

from raymcn.cli import preset_path
from raymcn.config import Config, ConfigError, all_keys, load_config

REQUIRED_KEYS = ["optim.lr", "data.batch_size", "data.clips_per_video", "loss.num_clusters", "schedule.epochs",
                 "schedule.stage_order", "schedule.stage1_fraction", "scale.num_workers", "scale.use_gpu",
                 "scale.cpus_per_worker", "data.shards", "data.eval_set"]


def test_documented_keys_exist():
    assert set(REQUIRED_KEYS) <= set(all_keys())


def test_defaults_are_the_papers():
    c = Config()
    assert (c.model.embed_dim, c.model.video_dim, c.model.word_dim) == (6144, 4096, 300)
    assert (c.loss.margin, c.loss.num_clusters, c.loss.refresh_every, c.loss.recon_weight) == (0.001, 256, 20, 50.0)
    assert (c.optim.lr, c.data.batch_size, c.data.clips_per_video) == (1e-4, 128, 32)
    # warm-up in videos: 640 000 = the paper's 5000 steps at its batch of 128 (tests/test_fidelity.py)
    assert (c.optim.warmup_videos, c.optim.warmup_steps) == (640_000, 0)
    assert c.clips_per_step == 4096
    assert c.queue_rows == 40960  # 20 steps x 16 clips x 128 videos, as the original's queue


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: 1.0e-3\nschedule:\n  stage_order: VT_A\n")
    c = load_config(f, ["optim.lr=3e-4", "scale.use_gpu=true", "model.audio_channels=[4,4,8,8,16]",
                        "data.eval_set=youcook:/x/y.pkl"])
    assert c.optim.lr == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as a string: typed against the field
    assert c.schedule.stage_order == "VT_A" and c.scale.use_gpu is True
    assert c.model.audio_channels == (4, 4, 8, 8, 16)
    assert Config.from_dict(c.to_dict()) == c
    assert c.replace({"optim.lr": 0.5}).optim.lr == 0.5


@pytest.mark.parametrize("override, fragment", [
    ("optim.lrr=1", "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("data.batch_size=1", "data.batch_size=1 is smaller than scale.num_workers=2"),
    ("schedule.stage_order=VA_T", "allowed values are AV_T, VT_A, AT_V, joint"),
    ("loss.num_clusters=5000", "loss.num_clusters=5000 is larger than the 4096 clips"),
    ("scale.use_gpu=perhaps", "scale.use_gpu: expected bool, got 'perhaps'"),
    ("optim.lr=-1", "optim.lr=-1.0: must be a positive number"),
    ("data.batch_size=abc", "data.batch_size: expected int, got 'abc'"),
    ("schedule.stage1_fraction=1.5", "schedule.stage1_fraction=1.5: must lie in [0, 1)"),
    ("data.eval_set=imagenet", "data.eval_set='imagenet': allowed values are synthetic, youcook:FILE, msrvtt:FILE"),
    ("loss.queue_dtype=float16", "loss.queue_dtype='float16': allowed values are float32, bfloat16"),
    ("model.audio_channels=[1,2]", "model.audio_channels=[1, 2]: needs 5 positive widths"),
    ("nosection.x=1", "unknown key 'nosection.x'"),
    ("optim.lr", "expected KEY=VALUE"),
    ("sweep.algorithm=hyperopt", "sweep.algorithm='hyperopt': allowed values are bohb, asha, optuna, random, grid"),
])
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)


@pytest.mark.parametrize("given, count, lo_hi", [
    ("3", 3, (3, 3)), ("1-2", (1, 2), (1, 2)), ("[1, 4]", (1, 4), (1, 4)), ("2-2", 2, (2, 2)),
])
def test_num_workers_is_a_count_or_an_elastic_range(given, count, lo_hi):
    c = load_config(None, [f"scale.num_workers={given}", "data.batch_size=8", "loss.num_clusters=8"])
    assert c.scale.num_workers == count
    assert (c.scale.min_workers, c.scale.max_workers) == lo_hi
    assert c.scale.elastic == (lo_hi[0] < lo_hi[1])
    assert Config.from_dict(c.to_dict()) == c  # a range survives the run's saved config


@pytest.mark.parametrize("given, fragment", [
    ("2-1", "scale.num_workers"), ("0-2", "1 <= min <= max"), ("[1, 2, 3]", "scale.num_workers"),
    ("many", "scale.num_workers"),
])
def test_bad_worker_ranges_name_the_key(given, fragment):
    with pytest.raises(ConfigError, match="scale.num_workers") as e:
        load_config(None, [f"scale.num_workers={given}"])
    assert fragment in str(e.value)


def test_the_batch_must_reach_every_worker_of_the_largest_group():
    with pytest.raises(ConfigError, match=r"data.batch_size=3 is smaller than scale.num_workers=4"):
        load_config(None, ["scale.num_workers=1-4", "data.batch_size=3", "loss.num_clusters=8"])


def test_gradient_caching_and_global_batchnorm_are_refused_together():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["scale.grad_cache_clips=64", "model.sync_batchnorm=true"])
    assert "scale.grad_cache_clips=64 with model.sync_batchnorm=true" in str(e.value) and "choose one" in str(e.value)
    for one in ("scale.grad_cache_clips=64", "model.sync_batchnorm=true"):
        load_config(None, [one])  # each alone is fine


def test_the_ring_on_workers_sharing_a_gpu_is_refused_before_ray_starts():
    """Workers sharing a GPU run over gloo, which has no send/recv for CUDA tensors: the ring would
    fail at its first step on the GPU, so the combination is refused at load."""
    shared = ["scale.use_gpu=true", "scale.num_workers=2", "scale.gpus_per_worker=0.5"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*shared, "scale.ring_contrastive=true"])
    assert "scale.ring_contrastive=true with scale.gpus_per_worker=0.5: workers that share a GPU talk over gloo, " \
           "which cannot send CUDA tensors" in str(e.value)
    for allowed in (shared, ["scale.use_gpu=true", "scale.num_workers=2", "scale.ring_contrastive=true"],
                    ["scale.gpus_per_worker=0.5", "scale.ring_contrastive=true"]):  # a GPU each; CPU workers
        load_config(None, allowed)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.lrr=1", "data.batch_size=1", "schedule.epochs=0", "loss.num_clusters=8"])
    assert len(e.value.problems) == 3


def test_sweep_space_checked(tmp_path):
    f = tmp_path / "sweep.yaml"
    f.write_text("sweep:\n  algorithm: bohb\n  space:\n"
                 "    optim.lrate: {loguniform: [1.0e-5, 1.0e-3]}\n"
                 "    optim.lr: {loguniform: [0, 1.0e-3]}\n"
                 "    schedule.stage_order: {choice: [AV_T, XX]}\n"
                 "    data.batch_size: {grid: [32, 64]}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "sweep.space.optim.lrate: unknown key 'optim.lrate' (did you mean 'optim.lr'?)" in msg
    assert "sweep.space.optim.lr: loguniform needs [low, high] with 0 < low < high" in msg
    assert "bohb does not accept grid domains" in msg


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_presets_are_valid():
    from pathlib import Path

    for f in [preset_path(), *Path(__file__).parents[1].joinpath("sweeps").glob("*.yaml")]:
        load_config(f)


def test_every_bound_is_declared_at_its_field_and_checked():
    """Bounds live in each field's metadata (one edit adds a setting); the one checker refuses a value
    past each bound, naming the key, and accepts the defaults."""
    import dataclasses

    from raymcn.config import SECTIONS, Config, ConfigError

    checked = 0
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if "ge" in meta or "gt" in meta:
                low = meta.get("ge", meta.get("gt"))
                bad = low - 1 if "ge" in meta else low  # just past the lower bound
            elif "choices" in meta:
                bad = "no-such-value"
            else:
                continue
            with pytest.raises(ConfigError) as e:
                Config().replace({f"{name}.{f.name}": bad})
            assert any(p.startswith(f"{name}.{f.name}=") for p in e.value.problems), (name, f.name, e.value.problems)
            checked += 1
    assert checked >= 40  # most settings carry a bound
    Config().replace({})  # the defaults satisfy every bound (replace validates)


def test_a_section_with_only_comments_is_an_empty_section(tmp_path):
    """YAML reads a section holding only comments as null: it is an empty section, which overrides
    of its keys then fill (the shipped sweep files have such a run: section)."""
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  # storage: set per cluster\nsweep:\n  confirm:\n    # off for now\n  space:\n")
    cfg = load_config(f, ["run.name=x", "optim.lr=0.01"])
    assert (cfg.run.name, cfg.sweep.confirm, cfg.sweep.space, cfg.optim.lr) == ("x", {}, {}, 0.01)
    assert load_config(f, ["sweep.confirm="]).sweep.confirm == {}


@pytest.mark.parametrize("text, fragment", [
    ("run: 3\n", "section 'run' must be a mapping of keys (key: value lines indented under it), got 3"),
    ("data:\n  - batch_size: 8\n", "section 'data' must be a mapping of keys"),
])
def test_a_section_that_is_not_a_mapping_names_the_file_and_section(tmp_path, text, fragment):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f, ["run.name=x"])
    assert f"config file {f}: {fragment}" in str(e.value)


def test_python_dash_m_raymcn_is_the_raymcn_command():
    """`python -m raymcn` (a shell without the venv's scripts on its PATH) parses as `raymcn` does
    and names a bad setting under the command's own name."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "raymcn", "config", "--set", "optim.lrr=1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "raymcn config: invalid configuration" in out.stderr
    assert "unknown key 'optim.lrr' (did you mean 'optim.lr'?)" in out.stderr
