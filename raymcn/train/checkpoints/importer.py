"""``raymcn import-original``: the original MCN release's checkpoint -> a raymcn checkpoint directory. No Ray.

The original writes two files: ``e{N}.pth``, a plain state dict, and
``amp_checkpoint.pt`` = ``{'net': state dict, 'optimizer', 'scheduler', 'amp'}``, whose ``net``
may carry DataParallel's ``module.`` prefix. Either is accepted. The tensors are renamed and
checked by :mod:`raymcn.model.original`; the result is a directory that ``raymcn eval
--checkpoint DIR`` and ``raymcn train --init-from DIR`` read like any raymcn checkpoint:

    DIR/state.pt            format, model (raymcn names), loop (step 0), config, imported_from
    DIR/raymcn_config.yaml  the resolved config (model section = what the shapes say)

torch is imported inside the functions: ``raymcn --help`` and the other commands stay fast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from raymcn.config import RUN_CONFIG_FILE, Config, ConfigError, ModelConfig, load_config

HELP = "convert the original MCN release's checkpoint (e{N}.pth or amp_checkpoint.pt) into a raymcn checkpoint"


@dataclass
class ImportResult:
    """What :func:`import_original` wrote: ``out`` holds state.pt and raymcn_config.yaml."""

    out: Path
    config: Config
    notes: list[str]
    imported_from: dict[str, Any]


def read_original(path: str | Path) -> tuple[Mapping[str, Any], str, list[str]]:
    """Load an original checkpoint file.

    Returns:
        (state dict with the original names, form "state_dict" | "amp_checkpoint", notes).

    Raises:
        OriginalCheckpointError: the file is missing, unreadable as plain tensors, or neither form.
    """
    import pickle

    import torch

    from raymcn.model.original import OriginalCheckpointError
    from raymcn.train.checkpoints.payload import unsafe_globals

    path = Path(path)
    if not path.is_file():
        raise OriginalCheckpointError([f"{path} does not exist or is not a file"])
    try:
        # Tensors and plain values only: both original files need nothing else, and a file that
        # does would run arbitrary code when unpickled (the release sits in a shared folder).
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        try:  # torch's first line names no type: say which ones the file holds
            foreign = sorted(unsafe_globals(path))
        except Exception:  # noqa: BLE001 - not a readable archive: the load's own error says more
            foreign = []
        if foreign:
            raise OriginalCheckpointError([f"{path} holds pickled objects of types a weights file never needs "
                                           f"({', '.join(foreign)}); refused, since loading them could run code "
                                           "from the file"]) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OriginalCheckpointError([f"{path} is not readable as a checkpoint of plain tensors "
                                       f"(torch.load with weights_only=True): {first}"]) from None
    if not isinstance(obj, Mapping):
        raise OriginalCheckpointError([f"{path} holds a {type(obj).__name__}; expected a state dict (e{{N}}.pth) "
                                       "or {'net': state dict, ...} (amp_checkpoint.pt)"])
    if {"format", "model", "config"} <= set(obj):
        raise OriginalCheckpointError([f"{path} is already a raymcn checkpoint: pass its directory to "
                                       "`raymcn eval --checkpoint` or `--init-from` directly"])
    if isinstance(obj.get("net"), Mapping):
        others = sorted(str(k) for k in obj if k != "net")
        note = ("read the amp_checkpoint.pt form: imported only its 'net' weights. Not imported: "
                f"{', '.join(others) or 'nothing else was there'}; that optimizer state holds the Adam moments "
                "of another implementation (apex O1 over DataParallel), so a run started from these weights "
                "gets a fresh optimizer, LR schedule, queue and centroids")
        return obj["net"], "amp_checkpoint", [note]
    return obj, "state_dict", []


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _model_overrides(inferred: ModelConfig) -> dict[str, Any]:
    return {f"model.{f.name}": getattr(inferred, f.name) for f in fields(ModelConfig)}


def import_original(source: str | Path, out: str | Path, base: Config | None = None,
                    force: bool = False, note_model_changes: bool = True) -> ImportResult:
    """Convert ``source`` and write the raymcn checkpoint directory ``out``.

    Args:
        source: an original ``e{N}.pth`` or ``amp_checkpoint.pt``.
        out: directory to write (created). Refused if it already holds a state.pt, unless ``force``.
        base: the run settings to store with the weights (data, loss, optim, ...); default the
            paper's defaults. Its model section is replaced by the inferred one, with a note per
            setting that changed (when ``base`` is given and ``note_model_changes``).

    Raises:
        OriginalCheckpointError: the file cannot be imported (one line per offending key).
        FileExistsError: ``out`` already holds a checkpoint and ``force`` is False.
    """
    from raymcn.model.original import convert
    from raymcn.train.checkpoints import payload as checkpoint
    from raymcn.train.run import LoopState

    source, out = Path(source).expanduser().resolve(), Path(out).expanduser()
    if (out / checkpoint.STATE_FILE).exists() and not force:
        raise FileExistsError(f"{out / checkpoint.STATE_FILE} exists; choose another --out or pass --force")
    state, form, notes = read_original(source)
    conversion = convert(state)
    notes += conversion.notes
    given = base is not None and note_model_changes
    base = base or Config()
    overrides = _model_overrides(conversion.model)
    if given:
        current = base.to_flat()
        notes += [f"{k}: the config says {current[k]!r}, the weights say {v!r}; the weights decide"
                  for k, v in overrides.items() if current[k] != (list(v) if isinstance(v, tuple) else v)]
    cfg = base.replace(overrides)
    epoch = re.fullmatch(r"e(\d+)\.pth", source.name)
    imported_from = {"file": str(source), "sha256": _sha256(source), "form": form,
                     "original_epoch": int(epoch.group(1)) if epoch else None, "notes": notes}
    checkpoint.save(out, model=conversion.state_dict, loop=LoopState(), config=cfg.to_dict(), metrics={},
                    imported_from=imported_from)
    cfg.dump(out / RUN_CONFIG_FILE)
    return ImportResult(out=out, config=cfg, notes=notes, imported_from=imported_from)


# --- the command -----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="the original e{N}.pth or amp_checkpoint.pt")
    parser.add_argument("--out", required=True, metavar="DIR", help="raymcn checkpoint directory to write")
    parser.add_argument("--config", help="run settings to store with the weights (default: the paper's); "
                                         "its model section is replaced by what the weights' shapes say")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override of the stored settings, e.g. --set data.eval_set=msrvtt:FILE")
    parser.add_argument("--force", action="store_true", help="overwrite DIR/state.pt if it exists")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    return parser


def run(args: argparse.Namespace) -> int:
    """``raymcn import-original``: 0 on success, 2 with every problem listed on stderr otherwise."""
    from raymcn.model.original import OriginalCheckpointError

    try:
        base = load_config(args.config, args.overrides) if (args.config or args.overrides) else None
        # Say where the weights overrule the model section only if the user wrote one.
        chose_model = bool(args.config) or any(o.strip().startswith("model.") for o in args.overrides)
        result = import_original(args.checkpoint, args.out, base=base, force=args.force,
                                 note_model_changes=chose_model)
    except OriginalCheckpointError as e:
        print(f"raymcn import-original: {args.checkpoint}: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # its message lists every problem
        print(f"raymcn import-original: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # FileExistsError (--out taken) too: the class says which
        print(f"raymcn import-original: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    model = result.config.model
    print(f"imported {result.imported_from['file']} ({result.imported_from['form']}) -> {result.out}")
    print("  model (from the shapes): " + ", ".join(
        f"{f.name}={getattr(model, f.name)}" for f in fields(ModelConfig)))
    for note in result.notes:
        print(f"  note: {note}")
    print(f"evaluate: raymcn eval --checkpoint {result.out} --eval-set msrvtt:FILE --word-vectors WORD2VEC.bin")
    print(f"train:    raymcn train --config {result.out / RUN_CONFIG_FILE} --init-from {result.out}")
    if args.json:
        print(json.dumps({"out": str(result.out), "model": result.config.to_dict()["model"],
                          **{k: result.imported_from[k] for k in ("file", "sha256", "form", "original_epoch")},
                          "notes": result.notes}), flush=True)
    return 0
