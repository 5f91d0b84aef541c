"""Distillation in Prefect and MLflow (issue 41): the teachers' references and their one tokenizer, the
``distill-translation`` flow's refusals, parameters and deployments, the distill stage's cache key, the report's
Distillation section (unit tier); and the flow end to end on the local stack (slow).

The stage function itself (``pipeline.distill``) is tested in tests/test_distill.py; the MLflow side of teacher
resolution and lineage against a real server in tests/test_tracking.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import QUICK, short_multi30k
from tests.conftest import REPO_ROOT as REPO
from tests.conftest import api as _api
from tests.test_report import stage_files, write

# ------------------------------------------------------------------------------------------ teacher references


@pytest.mark.parametrize("ref, parsed", [
    ("models:/transformer-en-de@champion", ("transformer-en-de", "champion", None)),
    ("models:/transformer-en-de/3", ("transformer-en-de", None, "3")),
    ("models:/my_model.v2@challenger-1", ("my_model.v2", "challenger-1", None)),
    ("runs/train/abc/averaged/last5.pt", (None, None, None)),
    ("/abs/teacher.pt", (None, None, None)),
])
def test_a_teacher_is_a_registered_version_or_a_checkpoint_file(ref: str, parsed: tuple) -> None:
    from pipeline.tracking import TeacherRef

    got = TeacherRef.parse(ref)
    assert (got.ref, got.name, got.alias, got.version) == (ref, *parsed)


@pytest.mark.parametrize("ref", ["models:/transformer-en-de", "models:/a/b/3", "models:/x@", "models:/x/v3",
                                 "runs:/abc/model", "teacher.ckpt", "transformer-en-de@champion"])
def test_a_teacher_of_no_known_form_is_refused_naming_the_forms(ref: str) -> None:
    from pipeline.tracking import TeacherError, TeacherRef

    with pytest.raises(TeacherError, match=re.escape(f"teacher {ref!r} is neither a registered version "
                                                     "(models:/<name>@<alias>, models:/<name>/<version>) nor a "
                                                     "checkpoint file (.pt)")):
        TeacherRef.parse(ref)


def _teacher(label: str, sha: str, tokenizer: str = "tok") -> object:
    from pipeline.tracking import Teacher

    return Teacher(f"models:/{label.replace('/', '@')}", label, Path(f"{label}.pt"), Path(tokenizer), sha,
                   1000, 1.5, "torch", "multi30k-val.sacrebleu", 30.0)


def test_teachers_of_different_tokenizers_are_refused_naming_them() -> None:
    """An ensemble averages the members' distributions over one vocabulary: teachers of two tokenizers are refused,
    each tokenizer with the teachers trained with it; teachers of one give its folder."""
    from pipeline.tracking import TeacherError, shared_tokenizer

    same = [_teacher("transformer-en-de/3", "a" * 64, "tok-a"), _teacher("transformer-en-de/4", "a" * 64, "tok-b")]
    assert shared_tokenizer(same) == Path("tok-a")
    mixed = [*same, _teacher("transformer-en-fr/1", "b" * 64)]
    with pytest.raises(TeacherError) as refused:
        shared_tokenizer(mixed)
    message = str(refused.value)
    assert ("the teachers do not share one tokenizer, so they cannot decode as one ensemble: transformer-en-de/3, "
            f"transformer-en-de/4 with tokenizer sha256 {'a' * 16}...; transformer-en-fr/1 with tokenizer sha256 "
            f"{'b' * 16}...") in message
    with pytest.raises(TeacherError, match="no teachers"):
        shared_tokenizer([])


def test_a_teacher_describes_its_version_score_and_size() -> None:
    t = _teacher("transformer-en-de/3", "a" * 64)
    assert t.describe() == ("transformer-en-de/3: multi30k-val.sacrebleu 30.00; 1,000 parameters; 1.50 MiB served "
                            "with torch")


def test_speeds_are_measured_on_sentences_with_one_label_per_model(tmp_path: Path) -> None:
    """Refused before any model loads (the paths do not exist): no sentences, or a label twice (speeds are keyed by
    label, so one would hide the other)."""
    from pipeline.config import DecodeConfig
    from pipeline.speed import Served, side_by_side

    a, b = Served("a", tmp_path / "a.pt", tmp_path), Served("a", tmp_path / "b.pt", tmp_path)
    with pytest.raises(ValueError, match="no sentences"):
        side_by_side([a], [], DecodeConfig())
    with pytest.raises(ValueError, match="each label once"):
        side_by_side([a, b], ["ein Satz"], DecodeConfig())


# ------------------------------------------------------------------------------------------------ the flow


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIAYN_DATA_ROOT", raising=False)
    monkeypatch.delenv("AIAYN_WORK_DIR", raising=False)


def test_a_config_without_teachers_is_refused_before_anything_runs(no_env) -> None:
    """Neither the config nor the run names a teacher: refused while resolving the config, before any stage or
    teacher run (the flow's body, called without Prefect: it gets no further)."""
    from flows.distill import distill_translation
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape("config 'multi30k-cpu' has no teachers (distill.teachers is "
                                                    "empty) and none were given")):
        distill_translation.fn(config="multi30k-cpu")
    with pytest.raises(ConfigError, match="has no teachers"):  # given as none: the config's are replaced
        distill_translation.fn(config="multi30k-student-tiny", teachers=[])
    with pytest.raises(ValueError, match="flow distill-translation needs {'task': 'translation'}"):
        distill_translation.fn(config="ptb-sample-semi-cpu", teachers=["models:/x@champion"])
    # a teacher config of another language pair is refused before any teacher trains
    with pytest.raises(ValueError, match=re.escape("config 'multi30k-en-fr-cpu' has {'tgt_lang': 'fr'}, but flow "
                                                   "distill-translation (teacher_configs) needs")):
        distill_translation.fn(config="multi30k-student-tiny", teacher_configs=["multi30k-cpu", "multi30k-en-fr-cpu"])


def test_teachers_reach_the_run_as_the_one_override(no_env) -> None:
    """``teachers`` replaces the config's distill.teachers and the versions teacher runs registered join them, as
    the override ``distill.teachers`` resolved with the rest of the config (a bad one is refused there)."""
    from flows.distill import student_config
    from pipeline.config import ConfigError

    def teachers(given, trained=()):
        return student_config("multi30k-student-tiny", None, None, given, list(trained), None, None, None
                              ).distill.teachers

    assert teachers(None) == ["models:/transformer-en-de@champion"]  # the config's
    assert teachers(["models:/transformer-en-de/3"]) == ["models:/transformer-en-de/3"]
    assert teachers(None, ["models:/t/1"]) == ["models:/t/1"]
    assert teachers(["runs/a.pt"], ["models:/t/1"]) == ["runs/a.pt", "models:/t/1"]  # a file: in the work dir
    with pytest.raises(ConfigError, match="distill.teachers"):
        teachers(["models:/transformer-en-de"])
    cfg = student_config("multi30k-student-tiny", None, {"train.seed": 3}, None, [], 5, None, None)
    assert (cfg.train.seed, cfg.train.max_steps, cfg.registered_model_name) == (3, 5, "transformer-en-de-student")


def test_the_flow_takes_teachers_and_teacher_configs_and_its_deployments_name_student_configs(no_env) -> None:
    """The run form: teachers and teacher_configs beside train-translation's parameters. prefect.yaml: each
    distill-translation deployment names a student config of its pair with a default teacher, registering as its
    own model; the local stack creates those models' promotion locks."""
    import yaml
    from prefect.utilities.callables import parameter_schema

    from flows.distill import distill_translation
    from flows.translation import train_translation
    from ops.localstack import deployed_models
    from pipeline.config import load_config

    schema = parameter_schema(distill_translation).model_dump_for_openapi()["properties"]
    train = parameter_schema(train_translation).model_dump_for_openapi()["properties"]
    assert set(schema) == set(train) | {"teachers", "teacher_configs"}
    assert schema["config"]["default"] == "multi30k-student-tiny"
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    found = {d["name"]: d["parameters"]["config"] for d in spec["deployments"]
             if d["entrypoint"] == "flows/distill.py:distill_translation"}
    assert found == {"multi30k-en-de": "multi30k-student-tiny", "multi30k-en-fr": "multi30k-en-fr-student-tiny"}
    for name, config in found.items():
        cfg = load_config(config)
        pair = f"{cfg.data.src_lang}-{cfg.data.tgt_lang}"
        assert name.endswith(pair) and cfg.registered_model_name == f"transformer-{pair}-student"
        assert cfg.distill.teachers == [f"models:/transformer-{pair}@champion"]
    assert {"transformer-en-de-student", "transformer-en-fr-student"} <= set(deployed_models())


def test_the_student_presets_are_the_tiny_recipe_and_the_deep_shallow_shape() -> None:
    from pipeline.config import load_config

    tiny, student = load_config("multi30k-cpu"), load_config("multi30k-student-tiny")
    for section in ("tokenizer", "model", "train", "average", "decode", "data", "export"):
        assert getattr(student, section) == getattr(tiny, section), section
    assert student.preset == "student-tiny" and student.distill.decode.length_penalty == tiny.decode.length_penalty
    deep = load_config("multi30k-student-deep-shallow")
    assert (deep.model.encoder_layers, deep.model.decoder_layers) == (6, 2)
    assert deep.model == tiny.model.model_copy(update={"encoder_layers": 6, "decoder_layers": 2, "norm": "pre"})
    fr = load_config("multi30k-en-fr-student-tiny")
    assert fr.decode == load_config("multi30k-en-fr-cpu").decode and fr.distill.decode.length_penalty == 1.0


def test_the_distill_stage_key_follows_the_teachers_content_not_their_path(tmp_path: Path) -> None:
    """A version downloaded again (or reached by another alias) keys the same distilled corpus; other weights or
    other settings do not."""
    from pipeline.config import load_config
    from tasks.stages import distill_stage

    def key(teachers, distill):
        ctx = SimpleNamespace(task=SimpleNamespace(name=distill_stage.name, fn=distill_stage.fn))
        return distill_stage.cache_key_fn(ctx, {"corpus": tmp_path, "teachers": teachers, "tokenizer_dir": tmp_path,
                                                "distill": distill, "work_dir": tmp_path})

    a, again, other = tmp_path / "a" / "last5.pt", tmp_path / "b" / "last5.pt", tmp_path / "c.pt"
    for path, content in ((a, b"weights"), (again, b"weights"), (other, b"other weights")):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content)
    distill = load_config("multi30k-student-tiny").distill
    assert key([a], distill) == key([again], distill)
    assert key([other], distill) != key([a], distill)
    assert key([a], distill.model_copy(update={"max_ratio": 2.0})) != key([a], distill)


def test_the_report_has_a_distillation_section(tmp_path: Path) -> None:
    from pipeline.config import load_config
    from pipeline.report import render_report

    stages = stage_files(tmp_path)
    rules = [{"rule": "empty", "removed": 3, "remaining": 28_997}, {"rule": "copy", "removed": 10, "remaining": 28_987},
             {"rule": "ratio", "removed": 87, "remaining": 28_900}]
    entry = {"source_corpus": {"fingerprint": "f" * 64, "path": "/w/corpus/fff"},
             "teachers": [{"path": "/w/teachers/transformer-en-de/3/last5.pt", "sha256": "0" * 64}],
             "decode": {"beam_size": 4, "length_penalty": 1.4}, "nbest": 1, "select": "best", "read": 29_000,
             "rules": rules, "kept": 28_900, "removed": {r["rule"]: r["removed"] for r in rules}, "truncated": 2}
    distilled = write(tmp_path / "distilled" / "abc" / "manifest.json", {"distillation": entry}).parent
    stages = {"data": stages["data"], "distill": (distilled, False), **stages}
    cfg = load_config("multi30k-student-tiny")
    lines = render_report(cfg, stages, None, None, ["transformer-en-de/3", "transformer-en-de/4"]).splitlines()
    at = lines.index("## Distillation")
    assert lines[at + 2] == ("Training targets translated by `transformer-en-de/3`, `transformer-en-de/4` (an ensemble "
                             "of 2): beam 4, length penalty 1.4, n-best 1, selection `best`; source corpus "
                             "`ffffffffffffffff`. Dev and test keep their human references.")
    assert lines[at + 4] == ("Training sources read 29,000, kept 28,900; removed by rule: empty 3, copy 10, ratio 87. "
                             "2 source(s) were cut to the teachers' positions.")
    assert "| distill | " in "\n".join(lines)  # a stage row, reused or ran
    write(distilled / "manifest.json", {"distillation": {**entry, "references": 29_000}})  # distill.keep_original
    mixed = render_report(cfg, stages, None, None, ["transformer-en-de/3"]).splitlines()
    assert mixed[at + 4].endswith("teachers' positions. The 29,000 human pairs train beside them "
                                  "(distill.keep_original).")
    # without names (the CLI's report), the teachers' checkpoint files
    text = render_report(cfg, stages, None, None)
    assert "translated by `/w/teachers/transformer-en-de/3/last5.pt`:" in text
    assert "## Distillation" not in render_report(cfg, stage_files(tmp_path / "plain"), None, None)


# ------------------------------------------------------------------------------------ end to end (slow)


@pytest.mark.slow
@pytest.mark.integration
def test_a_student_distils_from_a_teacher_trained_first_and_registers_with_its_lineage(stack, shared_data: Path,
                                                                                    tmp_path: Path) -> None:
    """``distill-translation/multi30k-en-de`` with a teacher config: the teacher trains and registers as a child
    flow run, then the student distils from that version (the config's default teacher replaced), trains and
    registers as its own model with its lineage; the same run again reuses the distilled corpus."""
    from mlflow.tracking import MlflowClient

    from ops.localstack import free_port
    from pipeline.config import load_config, write_resolved
    from pipeline.speed import cpu_name

    root = short_multi30k(shared_data, tmp_path / "data", train=3000, val=200, test2016=100, newstest2014=50)
    port = free_port()
    teacher_model, student_model = f"transformer-en-de-teacher-{port}", f"transformer-en-de-student-{port}"
    common = {**QUICK, "tracking.experiment": "distill-test"}
    teacher_config = write_resolved(load_config("multi30k-cpu", {**common, "tracking.registered_model": teacher_model}),
                                    tmp_path / "teacher.yaml")
    # the 10-update teacher writes short junk: kept whatever its length, so that the student has targets to learn
    student = {**common, "tracking.registered_model": student_model, "distill.decode.beam_size": 1,
               "distill.decode.min_len": 2, "distill.decode.max_len_a": 0.0, "distill.decode.max_len_b": 3,
               "distill.decode.batch_sentences": 512, "distill.max_ratio": 100.0, "distill.speed_sentences": 20}
    params = {"data_root": str(root), "overrides": student, "max_steps": 10, "teacher_configs": [str(teacher_config)]}
    prefect, mlflow = stack["prefect"], MlflowClient(stack["mlflow"])

    status, out, first = prefect.run_deployment("distill-translation/multi30k-en-de", params)
    assert status == 0, prefect.logs(first)[-4000:]
    (child,) = _api(prefect.api, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [first]}}})
    assert child["state"]["type"] == "COMPLETED" and child["name"].endswith("-teacher-1")
    assert child["parameters"]["config"] == str(teacher_config)
    teacher = mlflow.get_model_version_by_alias(teacher_model, "champion")  # its first version
    assert prefect.task_states(first)["distill-corpus"] == "Completed"

    exp = mlflow.get_experiment_by_name("distill-test")
    (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{first}'")
    children = {r.data.tags["stage"]: r for r in mlflow.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert sorted(children) == ["average", "data", "distill", "evaluate", "export", "register", "tokenize", "train"]
    distill = children["distill"]
    label = f"{teacher_model}/{teacher.version}"
    assert distill.data.tags["distill.teachers"] == label and distill.data.tags["cached"] == "false"
    metrics = distill.data.metrics
    assert metrics["distill.read"] == children["data"].data.metrics["corpus.train.rows"]  # every cleaned pair
    assert metrics["distill.kept"] == metrics["distill.read"] - sum(
        metrics[f"distill.removed.{r}"] for r in ("empty", "copy", "ratio")) > 0
    # the student preset keeps every human pair beside the teachers' (distill.keep_original, ledger L57)
    assert metrics["distill.references"] == metrics["distill.read"]
    (dataset,) = [d for d in distill.inputs.dataset_inputs if d.dataset.name == "distilled/train"]
    assert {t.key: t.value for t in dataset.tags}["mlflow.data.context"] == "distilled"

    (version,) = mlflow.search_model_versions(f"name = '{student_model}'")
    tags = version.tags
    assert tags["distill.teachers"] == label and tags["distill.teacher.1"].startswith(f"{label}: multi30k-val.")
    # trained on the distilled corpus, which came from the data stage's
    assert tags["corpus_fingerprint"][:16] == distill.data.tags["corpus_fingerprint"]
    assert tags["distill.source_corpus_fingerprint"][:16] == children["data"].data.tags["corpus_fingerprint"]
    assert int(tags["model.parameters"]) > 0 and float(tags["serving.model_mb"]) > 0
    assert f"| {label} | teacher |" in version.description and f"| {student_model}/1 | student |" in \
        version.description
    # the speeds of both, measured side by side at registration, with the machine named
    assert float(tags["distill.speedup"]) > 0 and "| sentences/s |" in version.description
    assert "20 dev sentences in one call" in version.description and cpu_name() in version.description
    assert tags["promotion.decision"] == "promoted"  # the first version of its own model
    report = {a["key"]: a for a in prefect.artifacts(first)}["multi30k-student-tiny-report"]["data"]
    assert "## Distillation" in report and f"`{label}`" in report

    status, out, second = prefect.run_deployment("distill-translation/multi30k-en-de", params)
    assert status == 0, prefect.logs(second)[-4000:]
    assert prefect.task_states(second)["distill-corpus"] == "Cached", prefect.logs(second)[-6000:]
    (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{second}'")
    (again,) = mlflow.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and "
                                                       "tags.stage = 'distill'")
    assert again.data.tags["cached"] == "true" and again.data.tags["distill.teachers"] == label
    assert parent.data.tags["promotion.decision"] == "no decision"  # the same student: nothing registered
