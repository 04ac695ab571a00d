"""Run and sweep configuration: one frozen dataclass per concern, built from YAML + dotted overrides.

Owns every setting name (``optim.lr``, ``data.batch_size`` ...), the table of metrics, and the checks
that must fail *before* Ray starts. Imports nothing from the rest of raymcn.

``names`` (names declared once, where presets and marks are), ``metrics`` (the retrieval metrics,
one table), ``errors`` (what a user is shown), ``sections`` (the eight sections: each setting, its
bounds and meaning), ``checks`` (each section's checks), ``loading`` (the whole :class:`Config`,
from YAML and overrides, and the checks across sections). Everything is imported from here:
``from raymcn.config import Config``.
"""

from raymcn.config.errors import shadowed_package_error

if (_shadowed := shadowed_package_error()) is not None:  # every raymcn command imports this first
    raise _shadowed
from raymcn.config.checks import CONFIRM_KEYS, field_problems, validate_sweep  # noqa: E402
from raymcn.config.errors import (
    ConfigError,
    NodeInputError,
    PermanentError,
    RayUnavailable,
    StorageError,
    doctor_hint,
    is_storage_error,
    permanent_cause,
    reason,
    storage_cause,
)
from raymcn.config.loading import (
    Config,
    default_cache_dir,
    default_storage_path,
    load_config,
    load_config_lenient,
    load_config_text,
    parse_override,
    validate,
)
from raymcn.config.metrics import (
    BEST,
    DEFAULT_OBJECTIVE,
    TRACKER_AT,
    Metric,
    best_values,
    Objective,
    metric,
    metric_names,
    metric_of_column,
    metric_table,
    objective,
    objective_choices,
    retrieval_values,
    tracker_name,
)
from raymcn.config.names import (
    COLLECTIVE_TIMEOUT_FACTOR,
    COLLECTIVE_TIMEOUT_MIN_FACTOR,
    CONFIRM_DIR,
    CONFIRM_PLAN_FILE,
    CONSOLE_LOG_FILE,
    DECISIONS_FILE,
    DEFAULT_PRESET,
    DRAIN_MARKS_DIR,
    EVAL_SET_KINDS,
    METRIC_PREFIX,
    METRICS_FILE,
    MID_EPOCH_KEY,
    MODALITIES,
    PROGRESS_FILE,
    RECORD_FILE,
    REHEARSAL_FILE,
    REHEARSAL_PREFIX,
    RUN_CONFIG_FILE,
    SEARCH_ALGORITHMS,
    SEARCH_DOMAINS,
    STAGE_ORDERS,
    SWEEP_CONFIG_FILE,
    TRACKERS,
    TRIAL_ERRORS_DIR,
    TRIAL_STATUS_FILE,
    drain_marks_dir,
    preset_path,
)
from raymcn.config.sections import (
    SECTIONS,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RunSection,
    ScaleConfig,
    ScheduleConfig,
    SweepConfig,
    Workers,
    all_keys,
    parse_interval,
    setting,
)

__all__ = [
    "BEST", "COLLECTIVE_TIMEOUT_FACTOR", "COLLECTIVE_TIMEOUT_MIN_FACTOR", "CONFIRM_DIR", "CONFIRM_KEYS", "CONFIRM_PLAN_FILE",
    "CONSOLE_LOG_FILE", "DECISIONS_FILE", "DEFAULT_OBJECTIVE", "DEFAULT_PRESET", "DRAIN_MARKS_DIR", "EVAL_SET_KINDS",
    "METRICS_FILE", "METRIC_PREFIX", "MID_EPOCH_KEY", "MODALITIES", "PROGRESS_FILE", "RECORD_FILE", "REHEARSAL_FILE",
    "REHEARSAL_PREFIX", "RUN_CONFIG_FILE",
    "SEARCH_ALGORITHMS", "SEARCH_DOMAINS", "SECTIONS", "STAGE_ORDERS", "SWEEP_CONFIG_FILE", "TRACKERS",
    "TRACKER_AT", "TRIAL_ERRORS_DIR", "TRIAL_STATUS_FILE", "Config", "ConfigError", "DataConfig", "LossConfig", "Metric",
    "ModelConfig", "NodeInputError", "Objective", "OptimConfig", "PermanentError", "RayUnavailable", "RunSection",
    "ScaleConfig", "ScheduleConfig", "SweepConfig", "Workers", "all_keys", "best_values", "default_cache_dir", "default_storage_path",
    "doctor_hint", "drain_marks_dir", "field_problems", "load_config", "load_config_text", "metric", "metric_names",
    "metric_of_column", "metric_table", "objective", "objective_choices", "parse_interval", "parse_override",
    "permanent_cause", "preset_path", "reason", "retrieval_values", "setting", "tracker_name", "validate",
    "validate_sweep", "StorageError", "is_storage_error", "load_config_lenient", "storage_cause",
]
