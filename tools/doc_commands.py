"""How the suite runs each command of the README's and the lab's guide's code blocks: one table,
which ``tests/test_docs.py`` checks and from which ``python -m tools.docgen`` writes
docs/development.md's list.

A command is keyed by its shape (``tests/test_docs.py``'s ``signature``: the program and subcommand,
then its flags, values left out). Each is one of

* :data:`RUN`: a named test runs it as the page writes it: one call of the test holds every word of
  the command (the test may add options of its own, such as its results folder or ``ray up -y``, and
  give a filled-in copy of ``cluster.yaml``), checked by reading the test's source;
* :data:`CHANGED`: a named test runs it with the change ``how`` says;
* :data:`PARSED`: no test runs it; ``how`` says why and what is checked instead (a ``ray`` or
  ``raymcn`` command shown is parsed by its real parser, run or not).

A test is named ``FILE::NAME``: a test function, a fixture or a helper in FILE; for a file that is
not Python, NAME is a line the file holds (``.ci/run::make test``: CI runs that line).
"""

from __future__ import annotations

from dataclasses import dataclass

RUN, CHANGED, PARSED = "run", "run with changes", "checked only"


@dataclass(frozen=True)
class Shown:
    kind: str  # RUN, CHANGED or PARSED
    tests: tuple[str, ...]  # where it runs, or what checks it
    how: str = ""  # CHANGED: what the tests change; PARSED: why none runs it, what is checked
    label: str = ""  # the command as development.md names it (default: its shape)


L, R, S = "tests/test_launcher.py", "tests/test_rehearsals.py", "tests/test_servers.py"
ROUTE = "tests/test_practice_route.py::test_the_practice_route_runs_as_the_guide_prints_it"  # on a CPU machine
LAB_FILES = "a synthetic corpus in that layout"

COMMANDS: dict[str, Shown] = {
    "make sweep": Shown(CHANGED, (f"{R}::test_make_sweep_killed_in_its_confirmation_resumes_it",
                                  f"{R}::test_the_default_preset_is_what_make_sweep_runs"),
                        "the embedded default, rehearsed"),
    "make test": Shown(RUN, (".ci/run::make test",)),
    "make install": Shown(RUN, (".ci/run::make install",)),
    "python3 --version": Shown(RUN, ("tests/test_install.py::test_the_guides_check_of_python_and_the_driver_prints_both",),
                                  label="`python3 --version && nvidia-smi | grep Driver`"),
    "source .venv/bin/activate": Shown(PARSED, ("Makefile::VENV ?= .venv",),
                                       "no test activates a shell; the Makefile's venv is `.venv`"),
    "raymcn train --config --json --num-workers": Shown(RUN, ("tests/test_train_ray.py::test_cli_smoke_run_learns",),
                                                        label="`raymcn train --config sweeps/smoke.yaml ...`"),
    "pip install": Shown(PARSED, ("tests/test_docs.py::test_the_pin_the_guide_installs_is_the_clusters",),
                         "a laptop install; the pin is `cluster.yaml`'s", "`pip install \"ray[...]\"`"),
    "ray get-auth-token --generate": Shown(RUN, (f"{L}::cluster",)),
    "raymcn shards --audio-features --captions --dry-run --features --out --video-list --word-vectors": Shown(
        CHANGED, ("tests/test_shard_dtype.py::test_dry_run_prints_the_sizes_per_dtype_and_writes_nothing", ROUTE),
        LAB_FILES + "; the practice route's as written", "`raymcn shards ... --dry-run`"),
    "raymcn synth --out --videos": Shown(RUN, (ROUTE,), label="`raymcn synth ...`"),
    "raymcn shards --audio-features --captions --features --out --video-list --word-vectors --workers": Shown(
        CHANGED, ("tests/test_e2e.py::test_synth_shards_train_eval", ROUTE),
        LAB_FILES + ", `--workers 2`; the practice route's as written", "`raymcn shards ... --workers 32`"),
    "ray up": Shown(RUN, (f"{L}::cluster", f"{L}::test_ray_up_installs_raymcn_and_pins_the_head"),
                    label="`ray up cluster.yaml`"),
    "ray up --no-restart": Shown(PARSED, ("tests/test_cluster_yaml.py::test_config_is_valid_for_ray_up",),
                                 "minutes in the launcher tier; its config is validated"),
    "ray exec | raymcn doctor --config --rehearse --step": Shown(
        CHANGED, ("tests/test_multinode.py::test_the_doctor_checks_every_node_and_estimates_the_sweep",
                  "tests/test_multinode.py::test_the_doctor_rehearses_the_lab_sweep_on_the_cluster"),
        "`--step` and `--rehearse` apart, on Ray's multi-node test cluster",
        "`ray exec ... 'raymcn doctor ...'`"),
    "ray submit --tmux | sweep.py --config": Shown(
        CHANGED, (f"{L}::test_a_killed_sweep_resumed_by_hand",
                  f"{R}::test_the_cluster_smoke_sweep_runs_to_its_end_and_its_terminal_reads_well"),
        "`sweeps/smoke.yaml`; the lab's files rehearsed",
        "`ray submit --tmux ... --config ...`"),
    "ray attach --tmux": Shown(PARSED, ("tests/test_docs.py::test_a_ray_command_shown_parses_with_rays_own_cli",),
                               "it takes over the terminal"),
    "ray exec | raymcn watch --once": Shown(CHANGED, ("tests/test_watch.py::test_once_console_contract",),
                                            "in-process", "`ray exec ... 'raymcn watch ...'`"),
    "ray exec | raymcn table": Shown(
        CHANGED, ("tests/test_confirm.py::test_the_table_of_a_confirmed_sweep_shows_both_phases_and_the_answer",),
        "in-process", "`ray exec ... 'raymcn table ...'`"),
    "raymcn drain --reboot": Shown(CHANGED, (f"{L}::test_drain_before_a_planned_reboot",
                                             f"{S}::test_drain_drains_this_node_then_reboots"),
                                   "`--deadline 20`, no reboot; `--reboot` against a mocked Ray"),
    "ray submit --tmux | sweep.py --resume": Shown(
        CHANGED, (f"{L}::test_a_killed_sweep_resumed_by_hand",
                  f"{R}::test_a_shipped_sweep_killed_in_its_search_resumes_to_its_answer"),
        "without `--tmux`; a rehearsal by its folder", "`ray submit --tmux ... --resume latest`"),
    "ray exec | raymcn sweep --stop": Shown(
        RUN, (f"{L}::test_the_boot_service_continues_the_unfinished_sweep_after_the_head_reboots",
              f"{S}::test_sweep_stop_latest_marks_the_sweep_a_boot_would_continue"),
        label="`ray exec ... 'raymcn sweep --stop latest'`"),
    "python -m pytest": Shown(PARSED, ("pyproject.toml::gpu: needs CUDA (skipped without it)",),
                              "needs CUDA; without it every `gpu` test skips",
                              "`python -m pytest -m gpu -s`"),
    "python -m bench.gpu_smoke --out": Shown(
        CHANGED, ("tests/test_gpu_smoke.py::test_the_gpu_smoke_runs_every_variant_without_ray",
                  "tests/test_gpu_smoke.py::test_on_the_gpu_the_estimate_is_never_below_the_peak"),
        "`--device cpu --smoke`; on a GPU, `--steps 3`"),
    "python -m bench.gpu_smoke --compare": Shown(
        CHANGED, ("tests/test_gpu_smoke.py::test_the_comparison_runs_every_lever_without_ray",
                  "tests/test_gpu_smoke.py::test_on_the_gpu_every_lever_keeps_the_estimate_above_its_peak"),
        "`--device cpu --smoke`; on a GPU, `--steps 2 --rounds 2`"),
    "raymcn train --config --rehearse --set": Shown(RUN, (ROUTE,), label="`raymcn train ... --rehearse ...`"),
    "raymcn sweep --config --rehearse --set": Shown(RUN, (ROUTE,), label="`raymcn sweep ... --rehearse ...`"),
    "raymcn train --config --set": Shown(
        CHANGED, (ROUTE,), "`--rehearse`, on the practice route's shards",
        "`raymcn train --config sweeps/paper.yaml --set ...`"),
}
