"""The model's parts by name (raymcn/model/parts.py): each branch a class chosen by its setting, the
original's by default; a new part is its class and its table entry (``tests/toy_parts.py``), and
everything else follows: the model, its state dict, the batch's text dtype, the preflight's checks
before Ray starts, the settings page. No Ray."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_MODEL, config
from toy_parts import TOY, OneLayerTextEncoder, empty_caption_batch, registered, toy_model

from raymcn import cli
from raymcn.config import MODALITIES, ModelConfig
from raymcn.data.formats.batch import random_batch
from raymcn.model import MCN
from raymcn.model.branch import word_mask
from raymcn.model.parts import PARTS, part_names, text_in_bf16
from raymcn.train.preflight import checks as preflight

TINY = config(TINY_MODEL).model
ORIGINAL_MODULES = ("gu_video", "davenet", "gu_audio", "audio_proj", "text_pool", "gu_text", "recon")


def test_every_part_setting_defaults_to_the_first_name_of_its_table():
    defaults = ModelConfig()
    assert set(PARTS) == {"video_encoder", "audio_encoder", "text_encoder", "recon_head"}
    for setting, table in PARTS.items():
        assert getattr(defaults, setting) == next(iter(table)), setting
    assert part_names() == {"model.video_encoder": ("gated",), "model.audio_encoder": ("davenet",),
                            "model.text_encoder": ("gated",), "model.recon_head": ("mlp",)}


def test_the_original_parts_keep_the_original_names_in_the_state_dict():
    """The original weights' import and every older checkpoint name the default parts' tensors at
    the top level (``gu_text.fc.weight``); the parts' own modules hold them under their setting."""
    model = MCN(TINY)
    keys = list(model.state_dict())
    assert {k.split(".")[0] for k in keys} == set(ORIGINAL_MODULES)
    assert "text_encoder.gu_text.fc.weight" in dict(model.named_parameters())
    wrapped = torch.nn.ModuleDict({"module": MCN(TINY)})  # as DDP holds it: every key under "module."
    wrapped.load_state_dict({f"module.{k}": v for k, v in model.state_dict().items()})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), wrapped["module"].state_dict().values()))
    assert list(wrapped.state_dict()) == [f"module.{k}" for k in keys]


def test_an_unknown_part_is_refused_naming_the_allowed_values():
    with pytest.raises(ValueError, match=r"model.text_encoder='transformer': allowed values are gated \(the parts"):
        MCN(dataclasses.replace(TINY, text_encoder="transformer"))


def test_a_bad_part_name_in_a_sweeps_space_fails_before_ray(no_ray, tmp_path, capsys):
    argv = ["sweep", "--set", "sweep.space={model.text_encoder: {grid: [gated, transformr]}}", "--set",
            "sweep.confirm={}", "--set", f"run.storage_path={tmp_path}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "sweep.space.model.text_encoder: model.text_encoder='transformr': allowed values are gated" in err, err


def test_the_doctor_refuses_a_bad_part_name_before_ray(no_ray, capsys):
    assert cli.main(["doctor", "--set", "model.audio_encoder=wav2vec"]) == 2
    assert "model.audio_encoder='wav2vec': allowed values are davenet" in capsys.readouterr().err


def test_a_new_part_is_its_class_and_table_entry():
    """The toy text encoder, registered: the model builds it, names its tensors under its setting,
    builds the text head for its own target width, and trains (finite loss and gradients)."""
    with registered():
        cfg = config(TINY_MODEL, **{"model.text_encoder": TOY})
        assert part_names()["model.text_encoder"] == ("gated", TOY)
        assert preflight.model_part_problems(cfg) == []
        torch.manual_seed(0)
        model = MCN(cfg.model)
    assert isinstance(model.text_encoder, OneLayerTextEncoder)
    keys = list(model.state_dict())
    assert [k for k in keys if k.startswith("text_encoder.")] and not [k for k in keys if k.startswith("gu_text")]
    assert model.recon["text"][2].out_features == cfg.model.word_dim  # the head rebuilds the part's own target
    out = model(random_batch(cfg, 6), MODALITIES)
    loss = sum(out[m].pow(2).mean() for m in MODALITIES) + sum((p - t).pow(2).mean()
                                                              for p, t in (out[f"recon_{m}"] for m in MODALITIES))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all()
                                        for p in model.text_encoder.parameters())


def test_an_empty_caption_keeps_attention_defined():
    """A caption none of whose words has a vector (nwords 0): the word count masks the padding, and
    word_mask keeps one (zero) key, so the attention's softmax has something to normalise."""
    with registered():
        model = MCN(toy_model(TINY)).eval()
    batch = empty_caption_batch(TINY)
    assert word_mask(batch["nwords"], 5).tolist()[0] == [True, False, False, False, False]
    with torch.no_grad():
        out = model(batch, ["text"])
    assert torch.isfinite(out["text"]).all() and torch.isfinite(out["recon_text"][1]).all()
    no_key = torch.full((5,), float("-inf"))  # attention scores with every key masked: what word_mask avoids
    assert torch.isnan(torch.softmax(no_key, 0)).all()


def test_the_text_dtype_on_the_way_in_is_the_text_encoders():
    """bf16 text only on a GPU run whose text encoder says autocast rounds it to bf16 anyway."""
    assert text_in_bf16(TINY, use_gpu=True) and not text_in_bf16(TINY, use_gpu=False)
    with registered():
        assert not text_in_bf16(toy_model(TINY), use_gpu=True)  # its default: float32 text


def test_the_settings_page_lists_the_table_names():
    from raymcn.reference import reference

    with registered():
        page = reference(part_names())
    row = next(line for line in page.splitlines() if line.startswith("| `model.text_encoder` |"))
    assert f"`gated` \\| `{TOY}` (a part named in `raymcn/model/parts.py`)" in row


def test_an_older_checkpoint_names_the_part_it_was_trained_with(tmp_path):
    """A checkpoint whose config predates the part settings was trained with the original parts:
    starting a run of another text encoder from it is refused, naming the setting that differs."""
    from raymcn.config import Config
    from raymcn.train.checkpoints import init_from
    from raymcn.train.checkpoints import payload as checkpoint
    from raymcn.train.checkpoints.payload import CheckpointError
    from raymcn.train.run import LoopState

    torch.manual_seed(1)
    trained = MCN(TINY)
    older = {k: v for k, v in Config(model=TINY).to_dict().items()}
    older["model"] = {k: v for k, v in older["model"].items() if k not in PARTS}  # as written before the parts
    where = tmp_path / "checkpoint_2026-01-01_00-00-00"
    checkpoint.save(where, model=trained, optimizer=torch.optim.Adam(trained.parameters()), loop=LoopState(step=1),
                    config=older)
    fresh = MCN(TINY)
    init_from.load_weights(fresh, where)  # the same parts: it loads as it always did
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.state_dict().items())
    with registered(), pytest.raises(CheckpointError, match="model.text_encoder: the checkpoint has 'gated', this run "
                                                            f"'{TOY}'.*unexpected: text_pool.fc.weight"):
        init_from.load_weights(MCN(toy_model(TINY)), where)
