"""Start from the released weights: import -> eval -> train/sweep --init-from.

The default tier needs no Ray: the importer, `raymcn eval`, the weight loading the workers call,
and every refusal of `--init-from` (they happen before Ray starts). The end-to-end test at the
bottom (import, eval, a sweep's trials trained from the weights) is marked `ray` and `slow`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import last_json
from original_ref import SMALL, OriginalReference, original_state_dict, save_original

import raymcn.cli as cli
from raymcn.cli import main, preset_path
from raymcn.config import RUN_CONFIG_FILE, Config, ModelConfig, load_config, metric_table
from raymcn.data.evalsets import load_eval_set
from raymcn.data.synthetic import SynthSettings, write_corpus
from raymcn.model import MCN
from raymcn.train.checkpoints import init_from
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.checkpoints.importer import import_original
from raymcn.train.checkpoints.payload import CheckpointError
from raymcn.train.inputs import resolve_inputs
from raymcn.train.preflight import checks as preflight
from raymcn.train.run import LoopState

# Run settings small enough for a CPU test; the model section comes from the weights.
RUN = ["data.synthetic_videos=64", "data.synthetic_eval_clips=64", "data.batch_size=16", "schedule.epochs=1",
       "scale.num_workers=1", "scale.cpus_per_worker=1"]



@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """(original-named state dict, its amp_checkpoint.pt with the 'module.' prefix)."""
    sd = original_state_dict(SMALL, seed=11)
    path = tmp_path_factory.mktemp("release") / "amp_checkpoint.pt"
    return sd, save_original(path, sd, form="amp", prefix=True)


@pytest.fixture(scope="module")
def imported(original, tmp_path_factory) -> Path:
    """The release imported with the embedded preset's run settings (shrunk further by RUN)."""
    out = tmp_path_factory.mktemp("imported") / "released"
    import_original(original[1], out, base=load_config(preset_path(), RUN))
    return out


def weights(state: dict) -> dict:
    """Parameters only: BN statistics move in any training step, whatever the learning rate."""
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


# --- eval --------------------------------------------------------------------------------------------
def test_eval_of_imported_weights_follows_the_msrvtt_protocol(original, imported, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", SynthSettings(videos=4, eval_clips=6, topics=3, word_dim=SMALL.word,
                                                             meaning_words=60, filler_words=8, msrvtt_clips=60))
    spec = f"msrvtt:{corpus.msrvtt_eval}"
    assert main(["eval", "--checkpoint", str(imported), "--eval-set", spec, "--word-vectors",
                 str(corpus.word_vectors), "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out
    got = last_json(out)
    over_all = "/".join(m.short for m in metric_table() if m.over_all_queries)  # R@1/R@5/... (config/metrics.py)
    assert f"{over_all} divide by 1000" in out and got["eval_size"] == 1000 and got["epochs"] == 0

    # Independently: the original's forward from the original tensors (with raymcn's ceil pooling
    # steps, its documented deviation), scores t . (v + a), rank = strictly greater scores.
    es = load_eval_set(spec, word_vectors=corpus.word_vectors, max_words=20)
    ref = OriginalReference(original[0], SMALL)
    with torch.no_grad():
        out = ref.forward(torch.as_tensor(es.video), torch.as_tensor(es.audio), torch.as_tensor(es.nframes),
                          torch.as_tensor(es.text), steps="ceil")
    scores = (out["text"] @ (out["video"] + out["audio"]).T).numpy()
    ranks = (scores > np.diag(scores)[:, None]).sum(axis=1)
    assert 50 <= len(ranks) < 60  # the pickle lacks the clips "without audio"
    for k in (1, 5, 10, 50):
        assert got[f"text_to_video_R@{k}"] == pytest.approx(100.0 * (ranks < k).sum() / 1000)
    assert got["text_to_video_MedR"] == pytest.approx(float(np.median(ranks)) + 1)  # over the present clips
    assert got["text_to_video_MeanR"] == pytest.approx(float(np.mean(ranks)) + 1)  # over the present clips too


# --- the loading every worker does ---------------------------------------------------------------
def test_load_weights_takes_every_tensor(imported):
    payload = checkpoint.load(imported)
    for path in (imported, imported / checkpoint.STATE_FILE):
        torch.manual_seed(0)
        model = MCN(Config.from_dict(payload["config"]).model)
        assert init_from.load_weights(model, path) == imported / checkpoint.STATE_FILE
        state = model.state_dict()
        assert set(state) == set(payload["model"])
        for key, value in payload["model"].items():
            assert torch.equal(state[key], value), key


def test_load_weights_from_a_raymcn_run_checkpoint(tmp_path):
    cfg = ModelConfig(embed_dim=16, audio_channels=(4, 4, 4, 8, 8), recon_hidden=8)
    torch.manual_seed(1)
    trained = MCN(cfg)
    optimizer = torch.optim.Adam(trained.parameters())
    run = tmp_path / "run"
    checkpoint.save(run / "checkpoint_2026-01-01_00-00-00", model=trained, optimizer=optimizer,
                    loop=LoopState(step=40, epoch=2), config=Config(model=cfg).to_dict())
    torch.manual_seed(2)
    fresh = MCN(cfg)
    init_from.load_weights(fresh, run / "checkpoint_2026-01-01_00-00-00")
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    with pytest.raises(CheckpointError, match="is a run directory, not a checkpoint; .*checkpoint_2026-01-01_00-00-00"):
        init_from.load_weights(fresh, run)
    with pytest.raises(CheckpointError, match="model.embed_dim: the checkpoint has 16, this run 24; set model"):
        init_from.load_weights(MCN(ModelConfig(embed_dim=24, audio_channels=(4, 4, 4, 8, 8), recon_hidden=8)),
                               run / "checkpoint_2026-01-01_00-00-00")


def test_load_weights_refuses_another_architecture(imported):
    model = MCN(load_config(preset_path()).model)  # the tiny preset: embed_dim 128
    with pytest.raises(CheckpointError) as info:
        init_from.load_weights(model, imported)
    message = str(info.value)
    assert str(imported) in message and "model.embed_dim: the checkpoint has 32, this run 128" in message
    assert f"--config {imported / RUN_CONFIG_FILE}" in message and "wrong shape: gu_video.fc.weight" in message


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d / "absent", "absent does not exist"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "holds no state.pt"),
    (lambda d: save_original(d / "e3.pth", {"x": torch.zeros(1)}), "raymcn import-original FILE --out DIR"),
])
def test_checkpoint_dir_errors_name_the_path(tmp_path, make, fragment):
    path = make(tmp_path)
    with pytest.raises(CheckpointError, match=fragment) as info:
        init_from.checkpoint_dir(path)
    assert str(path) in str(info.value)


# --- refusals before Ray starts ------------------------------------------------------------------
def test_train_init_from_missing_path_fails_before_ray(no_ray, tmp_path, capsys):
    assert main(["train", "--init-from", str(tmp_path / "nowhere"), "--set", f"run.storage_path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"run.init_from='{tmp_path / 'nowhere'}': {tmp_path / 'nowhere'} does not exist" in err, err


def test_train_init_from_incompatible_weights_fails_before_ray(no_ray, imported, tmp_path, capsys):
    # The default preset's tiny model cannot take the imported weights: the message says why and how.
    assert main(["train", "--init-from", str(imported), "--set", f"run.storage_path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "its weights do not fit this run's model" in err and "model.embed_dim: the checkpoint has 32" in err
    assert f"--config {imported / RUN_CONFIG_FILE}" in err


def test_sweep_cannot_vary_the_architecture_of_shared_weights(no_ray, imported, tmp_path, capsys):
    assert main(["sweep", "--config", str(imported / RUN_CONFIG_FILE), "--init-from", str(imported),
                 "--set", "sweep.space={model.recon_hidden: {choice: [12, 24]}}", "--set", "sweep.confirm={}",
                 "--set", f"run.storage_path={tmp_path}"]) == 2
    assert "sweeps model.recon_hidden while run.init_from is set" in capsys.readouterr().err


def test_resume_and_init_from_exclude_each_other(no_ray, imported, tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path), "--init-from", str(imported)]) == 2
    assert "--init-from starts a new run; --resume continues one" in capsys.readouterr().err


def test_compatible_run_and_sweep_pass_the_preflight(imported, tmp_path, monkeypatch):
    monkeypatch.chdir(imported.parent)  # a relative --init-from becomes absolute for the workers
    args = cli.build_parser().parse_args(["sweep", "--config", str(imported / RUN_CONFIG_FILE), "--init-from",
                                          imported.name, "--set", f"run.storage_path={tmp_path}"])
    cfg = cli.resolve_config(args)
    assert cfg.run.init_from == str(imported.resolve())
    assert preflight.static_problems(cfg, resolve_inputs(cfg), device_bytes=64 << 30) == []
    trial = Config.from_dict(cfg.to_dict()).replace({"optim.lr": 1e-3})  # as sweep.tuner.trial_fn builds a trial
    assert trial.run.init_from == cfg.run.init_from  # every trial starts from the same weights


# --- end to end with Ray (the full tier) ----------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_import_eval_then_every_sweep_trial_trains_from_the_same_weights(ray_local, original, tmp_path, capsys):
    """`raymcn import-original`, `raymcn eval` of what it wrote, then `raymcn sweep --init-from` (a
    run's `--init-from` is the same setting, ``run.init_from``, which every trial's workers load):
    each trial's lr so small that the weights cannot move measurably, so what it saved is what it
    started from, with a fresh step count, LR schedule and Adam moments."""
    out = tmp_path / "released"
    assert main(["import-original", str(original[1]), "--out", str(out), "--config", str(preset_path()),
                 *sum((["--set", s] for s in RUN), [])]) == 0
    assert main(["eval", "--checkpoint", str(out), "--device", "cpu", "--json"]) == 0  # the synthetic eval split
    assert last_json(capsys.readouterr().out)["eval_size"] == 64
    assert main(["sweep", "--config", str(out / RUN_CONFIG_FILE), "--init-from", str(out), "--json",
                 "--set", "sweep.algorithm=grid", "--set", "sweep.num_samples=1", "--set", "sweep.repeats=1",
                 "--set", "sweep.space={optim.lr: {grid: [1.0e-12, 2.0e-12]}}", "--set", "sweep.confirm={}",
                 "--set", f"run.storage_path={tmp_path / 'runs'}"]) == 0
    experiment = Path(last_json(capsys.readouterr().out)["experiment_dir"])
    trials = sorted((experiment / "train").glob("train-*"))
    assert len(trials) == 2
    start = weights(checkpoint.load(out)["model"])
    for trial in trials:
        payload = checkpoint.load(checkpoint.list_checkpoints(trial)[-1])
        for key, value in start.items():
            assert torch.allclose(payload["model"][key], value, atol=1e-8), (trial.name, key)
        steps = payload["loop"]["step"]
        assert steps == 4 and payload["loop"]["epoch"] == 1, trial.name  # a fresh run: 64 videos / 16 per step
        assert payload["scheduler"]["last_epoch"] == steps  # a fresh LR schedule
        assert all(int(s["step"]) == steps for s in payload["optimizer"]["state"].values())  # fresh Adam moments


def test_init_from_refuses_a_checkpoint_holding_another_pickled_object(tmp_path):
    checkpoint.save(tmp_path / "ck", model=torch.nn.Linear(2, 2), loop=LoopState())
    path = tmp_path / "ck" / checkpoint.STATE_FILE
    payload = torch.load(path, weights_only=False)
    payload["config"] = {"model": Path("anything")}  # a pathlib object: raymcn never saves one
    torch.save(payload, path)
    pickled = type(Path("anything"))  # pathlib.PosixPath, pathlib._local.PosixPath from Python 3.13
    named = re.escape(f"{pickled.__module__}.{pickled.__name__}")
    with pytest.raises(checkpoint.UnsafeCheckpointError, match=named) as info:
        init_from.read_model_state(tmp_path / "ck")
    assert str(path) in str(info.value)
