"""`raymcn import-original`: the original release's checkpoint into raymcn, checked key by key (no Ray).

The checkpoints are small-dimension variants of the original ``Net`` built from the spec's
Appendix A rules (``original_ref.py``), never copies of real weights. The round trip is checked
against a functional re-implementation of the original forward pass that reads the original
names directly, so it does not reuse raymcn's name table or model code.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import last_json
from original_ref import SMALL, Dims, OriginalReference, original_shapes, original_state_dict, save_original

from raymcn.cli import main
from raymcn.config import RUN_CONFIG_FILE, Config, ModelConfig, load_config
from raymcn.model import MCN
from raymcn.model.original import NAME_TABLE, OriginalCheckpointError, convert, to_original_name, to_raymcn_name
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.checkpoints.importer import import_original

SMALL_CFG = ModelConfig(video_dim=4096, word_dim=24, embed_dim=32, audio_channels=(4, 4, 8, 8, 16), audio_blocks=2,
                        mel_bins=40, recon=True, recon_hidden=12)


def err_of(capsys) -> str:
    return capsys.readouterr().err


def batch(b=4, frames=160, seed=1, nframes=(160, 80, 32, 400)):
    g = torch.Generator().manual_seed(seed)
    return {"video": torch.rand(b, 4096, generator=g), "audio": torch.randn(b, 40, frames, generator=g) * 10 - 40,
            "nframes": torch.tensor(nframes[:b], dtype=torch.int32), "text": torch.randn(b, 20, 24, generator=g)}


# --- the name table at paper size (spec Appendix A) -------------------------------------------------
def test_paper_size_checkpoint_maps_completely():
    shapes = original_shapes(Dims())
    assert len(shapes) == 159  # Appendix A: all 159 tensors
    for key, shape in [("DAVEnet.layer4.0.downsample.0.weight", (1024, 512, 1, 1)),
                       ("DAVEnet.layer2.1.conv2.weight", (256, 256, 1, 9)), ("DAVEnet.conv1.weight", (128, 1, 40, 1)),
                       ("GU_video.fc.weight", (6144, 4096)), ("GU_audio.cg.fc.weight", (1024, 1024)),
                       ("text_pooling_caption.fc.weight", (6144, 300)), ("recon_a.2.weight", (1024, 1024)),
                       ("recon_t.2.weight", (6144, 1024)), ("DAVEnet.batchnorm1.num_batches_tracked", ())]:
        assert shapes[key] == shape, key
    conv = convert(original_state_dict(Dims(), device="meta"))  # meta: nothing allocated
    assert conv.model == ModelConfig()  # every paper setting inferred from the shapes
    with torch.device("meta"):
        paper = MCN(ModelConfig()).state_dict()
    assert set(conv.state_dict) == set(paper) and len(paper) == 154  # 159 minus batchnorm1's 5
    weights = sum(v.numel() for k, v in conv.state_dict.items() if "running" not in k and "num_batches" not in k)
    assert round(weights / 1e6, 1) == 223.8  # the paper model's parameter count
    assert any("DAVEnet.batchnorm1" in n and "never uses it" in n for n in conv.notes)
    assert "running_var" in " ".join(conv.notes)  # all five of its tensors are listed


def test_name_table_is_one_to_one():
    with torch.device("meta"):
        keys = list(MCN(ModelConfig()).state_dict())
    originals = [to_original_name(k) for k in keys]
    assert None not in originals and len(set(originals)) == len(keys)
    assert [to_raymcn_name(o) for o in originals] == keys
    assert set(originals) == set(original_shapes(Dims())) - {k for k in original_shapes(Dims()) if "batchnorm1" in k}
    assert len({dst for _, dst in NAME_TABLE}) == len(NAME_TABLE)


# --- round trip: the same outputs as the original forward ------------------------------------------
@pytest.fixture(scope="module")
def small_sd():
    return original_state_dict(SMALL, seed=3)


def imported_model(sd) -> MCN:
    conv = convert(sd)
    assert conv.model == SMALL_CFG
    model = MCN(conv.model)
    model.load_state_dict(conv.state_dict, strict=True)
    return model


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to fp32 rounding. The rounding of a forward pass is relative to the magnitudes it
    sums, not to each output: an output near zero after cancellation carries the error of the
    large terms that cancelled. So the absolute tolerance scales with the tensor's largest value
    (measured: 3.8e-6 against 26.7 with the AVX-512 kernels, 2.6e-6 with the SSE4.1 and default
    kernels, where an element-wise rtol=1e-5 failed: 2.2e-5 on a small element). A wrong mapping is off by
    O(1)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=what)


def test_round_trip_eval_mode_matches_original_forward(small_sd):
    # nframes multiples of 16 (and one past T): the original's floor(nframes / 16) steps and raymcn's
    # ceil(min(nframes, T) * T' / T) agree there, so any difference would come from the mapping.
    model, ref = imported_model(small_sd).eval(), OriginalReference(small_sd, SMALL)
    b = batch()
    with torch.no_grad():
        got = model(b, ("video", "audio", "text"))
        want = ref.forward(b["video"], b["audio"], b["nframes"], b["text"])
    for key in ("video", "audio", "text"):
        assert_close(got[key], want[key], key)
        assert want[key].abs().mean() > 1e-3, key  # the comparison is not between two near-zero tensors
    for key in ("recon_video", "recon_audio", "recon_text"):
        for g, w in zip(got[key], want[key]):
            assert_close(g, w, key)


def test_round_trip_train_mode_matches_original_forward(small_sd):
    # Train mode: batch statistics in BN; with nframes >= T the masked mean is the original's plain mean.
    model, ref = imported_model(small_sd).train(), OriginalReference(small_sd, SMALL)
    b = batch(nframes=(160, 160, 200, 999))
    with torch.no_grad():
        got = model(b, ("video", "audio", "text"))
        want = ref.forward(b["video"], b["audio"], b["nframes"], b["text"], training=True)
    for key in ("video", "audio", "text"):
        assert_close(got[key], want[key], key)
    assert_close(got["recon_audio"][1], want["recon_audio"][1], "recon_audio")


def test_reference_detects_a_swapped_tensor(small_sd):
    # The round-trip check can fail: swap two same-shape tensors and the outputs differ.
    swapped = dict(small_sd)
    swapped["DAVEnet.layer3.1.conv1.weight"], swapped["DAVEnet.layer3.1.conv2.weight"] = (
        small_sd["DAVEnet.layer3.1.conv2.weight"], small_sd["DAVEnet.layer3.1.conv1.weight"])
    model, ref = imported_model(swapped).eval(), OriginalReference(small_sd, SMALL)
    b = batch()
    with torch.no_grad():
        assert not torch.allclose(model.encode(b)["audio"], ref.forward(b["video"], b["audio"], b["nframes"],
                                                                        b["text"])["audio"], rtol=1e-4, atol=1e-5)


# --- file forms --------------------------------------------------------------------------------------
@pytest.mark.parametrize("form, prefix, legacy", [("pth", False, False), ("pth", True, False), ("amp", False, False),
                                                  ("amp", True, False), ("pth", False, True), ("amp", True, True)])
def test_file_forms_import(tmp_path, small_sd, form, prefix, legacy):
    name = "e7.pth" if form == "pth" else "amp_checkpoint.pt"
    src = save_original(tmp_path / name, small_sd, form, prefix, legacy)
    result = import_original(src, tmp_path / "out")
    payload = checkpoint.load(tmp_path / "out")
    for key, value in small_sd.items():
        if "batchnorm1" not in key:
            assert torch.equal(payload["model"][to_raymcn_name(key)], value), key
    assert Config.from_dict(payload["config"]).model == SMALL_CFG
    assert load_config(tmp_path / "out" / RUN_CONFIG_FILE) == Config.from_dict(payload["config"]) == result.config
    src_info = payload["imported_from"]
    assert src_info["form"] == ("state_dict" if form == "pth" else "amp_checkpoint")
    assert src_info["original_epoch"] == (7 if form == "pth" else None) and len(src_info["sha256"]) == 64
    notes = " ".join(result.notes)
    assert ("module." in notes) == prefix
    assert ("optimizer" in notes and "Adam moments" in notes) == (form == "amp")
    assert "DAVEnet.batchnorm1" in notes
    assert payload["loop"]["step"] == 0 and payload["loop"]["epoch"] == 0


def test_half_precision_weights_are_cast_with_a_note(tmp_path, small_sd):
    half = {k: (v.half() if v.is_floating_point() else v) for k, v in small_sd.items()}
    result = import_original(save_original(tmp_path / "e1.pth", half), tmp_path / "out")
    model = checkpoint.load(tmp_path / "out")["model"]
    assert model["gu_video.fc.weight"].dtype == torch.float32
    assert any("float16" in n for n in result.notes)


# --- refusals: each names the key --------------------------------------------------------------------
def run_import(tmp_path, sd, capsys, *extra):
    src = save_original(tmp_path / "e1.pth", sd)
    code = main(["import-original", str(src), "--out", str(tmp_path / "out"), *extra])
    return code, err_of(capsys)


@pytest.mark.parametrize("key", ["DAVEnet.layer2.1.bn2.running_var", "GU_video.fc.weight",
                                 "text_pooling_caption.fc.weight"])  # the last one is also the only word_dim source
def test_missing_key_is_refused_naming_it(tmp_path, small_sd, capsys, key):
    code, err = run_import(tmp_path, {k: v for k, v in small_sd.items() if k != key}, capsys)
    assert code == 2 and f"{key}: missing" in err, err
    assert err.count("\n  - ") == 1, err  # exactly that one problem
    assert not (tmp_path / "out" / checkpoint.STATE_FILE).exists()


@pytest.mark.parametrize("extra_key, shape", [("classification.weight", (256, 32)),  # a --withMLP leftover
                                              ("DAVEnet.layer1.2.conv1.weight", (4, 4, 1, 9)),  # a third block
                                              ("GU_video.fc.scale", (32,))])
def test_extra_key_is_refused_naming_it(tmp_path, small_sd, capsys, extra_key, shape):
    code, err = run_import(tmp_path, {**small_sd, extra_key: torch.zeros(shape)}, capsys)
    assert code == 2 and f"{extra_key}: " in err, err
    assert err.count("\n  - ") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, shape", [("GU_video.cg.fc.weight", (32, 31)),
                                        ("DAVEnet.layer3.0.conv2.weight", (8, 8, 1, 7)),
                                        ("GU_video.fc.weight", (32, 4000))])  # also a video_dim source
def test_wrong_shape_is_refused_naming_it(tmp_path, small_sd, capsys, key, shape):
    code, err = run_import(tmp_path, {**small_sd, key: torch.zeros(shape)}, capsys)
    assert code == 2 and key in err and str(shape) in err, err
    assert not (tmp_path / "out").exists()


def test_every_problem_is_listed_at_once(small_sd):
    sd = {k: v for k, v in small_sd.items() if k != "recon_t.0.bias"}
    sd.update({"projection_head.0.weight": torch.zeros(4, 32), "GU_audio.cg.fc.bias": torch.zeros(15)})
    with pytest.raises(OriginalCheckpointError) as info:
        convert(sd)
    named = " ".join(info.value.problems)
    assert len(info.value.problems) == 3
    for key in ("recon_t.0.bias", "projection_head.0.weight", "GU_audio.cg.fc.bias"):
        assert key in named


def test_not_a_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "notes.pth").write_bytes(b"not a torch file")
    assert main(["import-original", str(tmp_path / "notes.pth"), "--out", str(tmp_path / "out")]) == 2
    assert "notes.pth is not readable as a checkpoint" in err_of(capsys)
    torch.save([1, 2, 3], tmp_path / "list.pth")
    assert main(["import-original", str(tmp_path / "list.pth"), "--out", str(tmp_path / "out")]) == 2
    assert "holds a list" in err_of(capsys)
    assert main(["import-original", str(tmp_path / "absent.pth"), "--out", str(tmp_path / "out")]) == 2
    assert "absent.pth does not exist" in err_of(capsys)


def test_a_release_file_holding_another_pickled_object_is_refused_naming_its_type(tmp_path, small_sd, capsys):
    import argparse

    torch.save({"net": small_sd, "args": argparse.Namespace(lr=1e-4)}, tmp_path / "amp_checkpoint.pt")
    assert main(["import-original", str(tmp_path / "amp_checkpoint.pt"), "--out", str(tmp_path / "out")]) == 2
    err = err_of(capsys)
    assert f"{tmp_path / 'amp_checkpoint.pt'} holds pickled objects of types a weights file never needs " \
           "(argparse.Namespace); refused" in err, err


def test_existing_output_needs_force(tmp_path, small_sd, capsys):
    src = save_original(tmp_path / "e1.pth", small_sd)
    assert main(["import-original", str(src), "--out", str(tmp_path / "out")]) == 0
    assert main(["import-original", str(src), "--out", str(tmp_path / "out")]) == 2
    assert f"raymcn import-original: FileExistsError: {tmp_path / 'out'}" in (err := err_of(capsys)), err
    assert "exists; choose another --out or pass --force" in err
    assert main(["import-original", str(src), "--out", str(tmp_path / "out"), "--force"]) == 0


def test_an_output_folder_that_cannot_be_written_is_named_by_its_error(tmp_path, small_sd, capsys):
    src = save_original(tmp_path / "e1.pth", small_sd)
    (tmp_path / "file").write_text("not a folder")
    assert main(["import-original", str(src), "--out", str(tmp_path / "file" / "out")]) == 2
    err = err_of(capsys)
    assert err.startswith("raymcn import-original: NotADirectoryError: "), err


def test_config_file_keeps_run_settings_and_weights_decide_the_model(tmp_path, small_sd, capsys):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"optim": {"lr": 3e-5}, "model": {"embed_dim": 64}}))
    src = save_original(tmp_path / "e1.pth", small_sd)
    assert main(["import-original", str(src), "--out", str(tmp_path / "out"), "--config", str(tmp_path / "run.yaml"),
                 "--set", "data.batch_size=32", "--json"]) == 0
    out = capsys.readouterr().out
    summary = last_json(out)
    assert summary["model"]["embed_dim"] == 32 and summary["form"] == "state_dict"
    assert "model.embed_dim: the config says 64, the weights say 32; the weights decide" in out
    cfg = load_config(tmp_path / "out" / RUN_CONFIG_FILE)
    assert cfg.optim.lr == 3e-5 and cfg.data.batch_size == 32 and cfg.model == SMALL_CFG


def test_bad_settings_are_refused_and_run_keys_alone_leave_no_model_notes(tmp_path, small_sd, capsys):
    src = save_original(tmp_path / "e1.pth", small_sd)
    assert main(["import-original", str(src), "--out", str(tmp_path / "a"), "--config", str(tmp_path / "no.yaml")]) == 2
    assert "no.yaml does not exist" in err_of(capsys)
    assert main(["import-original", str(src), "--out", str(tmp_path / "a"), "--set", "optim.lrr=1"]) == 2
    assert "unknown key 'optim.lrr'" in err_of(capsys)
    assert main(["import-original", str(src), "--out", str(tmp_path / "b"), "--set", "optim.lr=2e-5"]) == 0
    out = capsys.readouterr().out
    assert "the weights decide" not in out  # no model section was chosen, so nothing was overruled
    assert load_config(tmp_path / "b" / RUN_CONFIG_FILE).optim.lr == 2e-5
