"""The config as Prefect flow parameters: the run configs a flow run can name, and ``overrides``, every config field
under its dotted name, typed and constrained as in the schema."""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, create_model

from pipeline.config.base import constrained_type, schema_leaves
from pipeline.config.run import RunConfig

# The run configs under configs/ a flow run can name (tests/test_config.py keeps this equal to the files); a flow
# also takes the path of a config file there or in a folder of AIAYN_CONFIG_DIRS (pipeline.config.trust).
ConfigName = Literal["multi30k-cpu", "multi30k-cpu-hub", "multi30k-cpu-weekly", "multi30k-en-fr-cpu",
                     "multi30k-en-fr-student-tiny", "multi30k-student-deep-shallow", "multi30k-student-tiny",
                     "multi30k-teacher-gpu", "ptb-sample-cpu", "ptb-sample-semi-cpu", "wmt14-en-de-base",
                     "wmt14-en-de-big", "wmt14-en-fr-base", "wmt14-en-fr-big", "wsj-parsing"]


def _flow_overrides_model() -> type[BaseModel]:
    # each field keeps its description: Prefect's run form shows it
    fields = {key.replace(".", "__"): (constrained_type(field) | None,
                                       Field(default=None, alias=key, description=field.description))
              for key, field in schema_leaves(RunConfig) if key not in ("name",)}
    return create_model("FlowOverrides", __config__=ConfigDict(extra="forbid"), **fields)


# A flow's ``overrides`` parameter: every config field under its dotted name (``train.warmup_steps``), typed and
# constrained as in the schema, nothing else. Prefect renders it as a form and, since deployments enforce their
# parameter schema, refuses a run with an unknown key or a wrong value when it is created, naming the field; the
# whole config (cross-field rules included) is validated once more when the run resolves it.
FlowOverrides = _flow_overrides_model()


def flow_overrides(overrides: BaseModel | Mapping[str, Any] | None) -> dict[str, Any]:
    """A flow's ``overrides`` parameter as dotted keys: the fields the caller set, nothing else."""
    if isinstance(overrides, BaseModel):
        return overrides.model_dump(by_alias=True, exclude_unset=True)
    return dict(overrides or {})
