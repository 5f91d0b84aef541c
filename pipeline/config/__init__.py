"""Typed configuration: one schema, YAML presets in ``configs/``, dotted overrides.

A run is described by one :class:`RunConfig`. It is resolved once, at the top (CLI or flow), from a YAML file
that may ``extends:`` other YAML files (presets such as ``presets/base``), then dotted overrides
(``train.max_steps=200`` from the CLI, or a dict from Prefect deployment parameters). The result is validated
strictly: an unknown key, a wrong type or an impossible value fails here, naming the field, never hours later.

Defaults equal the paper (Vaswani et al., 2017, "base" row of Table 3); every deviation lives in a preset file
and is named there.

The package, by concern (import from here; the modules are its parts):

- :mod:`~pipeline.config.base`: where configs are, :class:`ConfigError`, the strict base of every section, the mark
  of a field outside the run's identity, the dotted keys of the schema and of a tree;
- the schema, a module per section: :mod:`~pipeline.config.data`, :mod:`~pipeline.config.tokenizer`,
  :mod:`~pipeline.config.model`, :mod:`~pipeline.config.train`, :mod:`~pipeline.config.evaluation` (average, decode,
  export), :mod:`~pipeline.config.tracking`, :mod:`~pipeline.config.distill`, :mod:`~pipeline.config.launch`, and
  the root, :mod:`~pipeline.config.run`;
- :mod:`~pipeline.config.yaml_loader`: the hardened YAML loader;
- :mod:`~pipeline.config.resolve`: presets, recipes, the environment and overrides to one validated config;
- :mod:`~pipeline.config.flow_params`: the config as Prefect flow parameters;
- :mod:`~pipeline.config.trust`: what a flow run's parameters may choose (the trust model's rules).
"""

from pipeline.config.base import (CONFIG_DIR, OUTSIDE_RUN_IDENTITY, REPO_ROOT, ConfigError, DevDomainWarning, Strict,
                                  canonical_json, constrained_type, outside_run_identity, schema_leaves, tree_leaves,
                                  unshown_character)
from pipeline.config.data import CleaningConfig, DataConfig, SourceFormat, SourceSpec
from pipeline.config.distill import DistillConfig
from pipeline.config.evaluation import AverageConfig, DecodeConfig, ExportConfig
from pipeline.config.flow_params import ConfigName, FlowOverrides, flow_overrides
from pipeline.config.launch import LaunchConfig
from pipeline.config.model import ModelConfig
from pipeline.config.resolve import (ENV_CONFIG_DIRS, ENV_DATA_ROOT, ENV_WORK_DIR, RECIPE_SECTIONS, Overrides,
                                     apply_overrides, deep_merge, dump_config, ensure_work_dir, load_config,
                                     load_resolved, resolve_config, resolve_config_path, write_resolved)
from pipeline.config.run import RunConfig, Task
from pipeline.config.tokenizer import SpecialIds, TokenizerConfig
from pipeline.config.tracking import TrackingConfig
from pipeline.config.train import TrainConfig
from pipeline.config.trust import ENV_RUNS_MAY_SET, POOL_DECIDES, FlowRunTrust
from pipeline.config.yaml_loader import (MAX_YAML_VALUES, DuplicateKey, TooLarge, YamlLoader, load_yaml, parse_value,
                                         read_yaml_file)

__all__ = [
    "CONFIG_DIR", "ENV_CONFIG_DIRS", "ENV_DATA_ROOT", "ENV_RUNS_MAY_SET", "ENV_WORK_DIR", "MAX_YAML_VALUES",
    "OUTSIDE_RUN_IDENTITY", "POOL_DECIDES", "RECIPE_SECTIONS", "REPO_ROOT", "AverageConfig", "CleaningConfig",
    "ConfigError", "ConfigName", "DataConfig", "DecodeConfig", "DevDomainWarning", "DistillConfig", "DuplicateKey",
    "ExportConfig", "FlowOverrides", "FlowRunTrust", "LaunchConfig", "ModelConfig", "Overrides", "RunConfig",
    "SourceFormat", "SourceSpec", "SpecialIds", "Strict", "Task", "TokenizerConfig", "TooLarge", "TrackingConfig",
    "TrainConfig", "YamlLoader", "apply_overrides", "canonical_json", "constrained_type", "deep_merge", "dump_config",
    "ensure_work_dir", "flow_overrides", "load_config", "load_resolved", "load_yaml", "outside_run_identity",
    "parse_value", "read_yaml_file", "resolve_config", "resolve_config_path", "schema_leaves", "tree_leaves",
    "unshown_character", "write_resolved",
]
