"""The sweep: its config, the controller's search and pruning, the confirmation's statistics and the winner preset
(unit: Optuna in memory and a scripted runner in place of the work pool); and the real thing on the local stack."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.promotion import paired_bootstrap, pooled_bootstrap
from pipeline.sweep.config import SweepConfig, base_point, check_space, expand, load_sweep, resolve_base
from pipeline.sweep.search import ATTEMPTS, Arm, Outcome, arms, confirm, open_storage, open_study, run_key, search
from pipeline.sweep.verdict import judge, leaderboard, markdown, winner, write_winner

REFS = [f"ein mann mit einem roten hut steht vor dem haus nummer {i} und wartet auf den bus" for i in range(120)]


def _tree(tmp_path: Path, **over) -> dict:
    tree = {"name": "t", "base": "multi30k-cpu", "deployment": "train-en-de/multi30k-cpu", "trials": 4,
            "max_in_flight": 2, "storage": f"sqlite:///{tmp_path / 'optuna.db'}", "poll_s": 0.01,
            "trial_overrides": {"export.engine": "none", "recipe": "none"},  # the config as written on every CPU
            "space": {"train.warmup_steps": {"type": "int", "low": 500, "high": 2000, "step": 50},
                      "model": {"type": "group", "options": {
                          "small": {"model.d_model": 256, "model.d_ff": 1024},
                          "wide": {"model.d_model": 384, "model.d_ff": 1536, "model.n_heads": 6}}}},
            "pruner": {"min_resource_s": 10, "max_resource_s": 90, "reduction_factor": 3},
            "confirm": {"top_k": 1, "seeds": [1, 2], "resamples": 200}}
    return {**tree, **over}


def _sweep(tmp_path: Path, **over) -> SweepConfig:
    return SweepConfig.model_validate(_tree(tmp_path, **over))


def test_sweep_config_names_bad_fields_and_the_base_must_be_a_point(tmp_path):
    sweep = load_sweep("multi30k-cpu")
    base = load_config(sweep.base, ["recipe=none"])  # the preset as written, on any CPU
    point = base_point(sweep, base)
    assert point["model"] == "3x256" and point["tokenizer.vocab_size"] == base.tokenizer.vocab_size
    # a CPU that trains in fp32 starts from the fp32 recipe's width, which is a point of the space too
    fp32 = base_point(sweep, load_config(sweep.base, ["recipe=fp32"]))
    assert (fp32["model"], fp32["batch"], fp32["train.cooldown"]) == ("3x128", "2048", 0.3)
    check_space(sweep, fp32)
    # a group expands to its fields; the fixed trial overrides come first, a winner's preset leaves them out
    assert expand(sweep, point)["model.d_ff"] == 1024 and expand(sweep, point)["export.engine"] == "none"
    assert "export.engine" not in expand(sweep, point, fixed=False)
    with pytest.raises(ValueError, match="'train.warmup_step' is not a config field"):
        _sweep(tmp_path, space={"train.warmup_step": {"type": "int", "low": 1, "high": 2}})
    with pytest.raises(ValueError, match="needs low <= high"):
        _sweep(tmp_path, space={"train.warmup_steps": {"type": "int", "low": 3, "high": 2}})
    off_grid = _sweep(tmp_path, space={"train.warmup_steps": {"type": "int", "low": 1500, "high": 2000}})
    with pytest.raises(ConfigError, match=r"train.warmup_steps=1000, outside space.train.warmup_steps"):
        base_point(off_grid, base)
    check_space(sweep, point)  # every value of the shipped sweep makes a valid config
    bad = _sweep(tmp_path, space={"model": {"type": "group", "options": {
        "base": {"model.d_model": 256}, "odd": {"model.d_model": 250}}}})
    with pytest.raises(ConfigError, match=r"space.model = 'odd' makes an invalid config: .*divisible by n_heads"):
        check_space(bad, base_point(bad, base))
    with pytest.raises(ValueError, match=r"enqueue\[0\]: \['train.seed'\] are not keys of the space"):
        _sweep(tmp_path, enqueue=[{"train.seed": 2}])
    with pytest.raises(ConfigError, match="sweep 'nope' not found"):
        load_sweep("nope")


def _sweep_file(tmp_path: Path, text: str = "", **over) -> Path:
    """The shipped sweep written to ``tmp_path`` with ``over`` replacing its top-level keys (or ``text`` as it is)."""
    tree = {**yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "sweeps" / "multi30k-cpu.yaml")
                             .read_text(encoding="utf-8")), **over}
    path = tmp_path / "x.yaml"
    path.write_text(text or yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return path


def test_a_sweep_file_is_refused_whole_before_anything_starts_naming_the_file_and_the_field(tmp_path, monkeypatch):
    """Every hunch value inside its dimension, every dimension well-formed, a field set in one place only, every
    hunch a valid run config, and a key written once: checked when the file is loaded (Optuna would refuse a hunch
    or a log range at 0 only when the study first asks for it, after the sweep's MLflow run and the base's trial run
    exist, 30 minutes in on the shipped sweep)."""
    import flows.sweep as module

    shipped = load_sweep("multi30k-cpu")
    space = {k: v.model_dump(exclude_unset=True) for k, v in shipped.space.items()}

    def refused(match: str, **over) -> None:
        path = _sweep_file(tmp_path, **over)
        with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + match):
            load_sweep(path)

    refused(r"enqueue\[1\]\.batch = '1024' is not an option of space\.batch: \['2048', '4096', '2x4096'\]",
            enqueue=[{"train.rdrop_alpha": 1.0}, {"batch": "1024"}])
    refused(r"enqueue\[0\]\.batch = 2048 is not an option .*labels are strings: write '2048'",
            enqueue=[{"batch": 2048}])
    refused(r"enqueue\[0\]\.model\.dropout = 0\.95 is not one of the choices of space\.model\.dropout: "
            r"\[0\.1, 0\.2, 0\.3\]", enqueue=[{"model.dropout": 0.95}])
    refused(r"enqueue\[0\]\.model\.dropout = 0\.95 is outside space\.model\.dropout \[0\.0, 0\.5\]: pick a value",
            space={**space, "model.dropout": {"type": "float", "low": 0.0, "high": 0.5}},
            enqueue=[{"model.dropout": 0.95}])
    refused(r"enqueue\[0\]\.train\.warmup_steps = 600 is not on the grid of space\.train\.warmup_steps: "
            r"500 \+ k \* 250 up to 2000", enqueue=[{"train.warmup_steps": 600}])
    refused(r"enqueue\[0\]\.train\.warmup_steps = True is not a number", enqueue=[{"train.warmup_steps": True}])
    refused(r"enqueue\[0\]\.train\.rdrop_alpha = True is not one of the choices", enqueue=[{"train.rdrop_alpha": True}])
    refused(r"space\.train\.lr_scale: log needs low > 0 .*got low 0\.0",
            space={**space, "train.lr_scale": {"type": "float", "low": 0, "high": 2, "log": True}})
    refused(r"space\.train\.warmup_steps: log needs low > 0 .*got low 0$",
            space={**space, "train.warmup_steps": {"type": "int", "low": 0, "high": 2000, "log": True}})
    refused(r"space\.train\.warmup_steps: type 'int' needs whole numbers",
            space={**space, "train.warmup_steps": {"type": "int", "low": 0.5, "high": 2000}})
    refused(r"space\.train\.warmup_steps: high 2100 is not on the grid .*set high to 2000",
            space={**space, "train.warmup_steps": {"type": "int", "low": 500, "high": 2100, "step": 250}})
    refused(r"space\.train\.warmup_steps: step must be > 0",
            space={**space, "train.warmup_steps": {"type": "int", "low": 500, "high": 2000, "step": -250}})
    refused(r"space\.model\.dropout: \['low'\] do not apply to type 'categorical'",
            space={**space, "model.dropout": {**space["model.dropout"], "low": 0.1}})
    refused(r"space\.model\.dropout: choices \[0\.1\] are listed more than once",
            space={**space, "model.dropout": {"type": "categorical", "choices": [0.1, 0.2, 0.1]}})
    refused(r"space\.batch and trial_overrides both set train\.max_tokens",
            trial_overrides={**shipped.trial_overrides, "train.max_tokens": 1024})
    refused(r"space\.model\.dropout and space\.model both set model\.dropout", space={**space, "model": {
        "type": "group", "options": {k: {**o, "model.dropout": 0.2} for k, o in space["model"]["options"].items()}}})
    refused(r"storage: 'optuna\.db' is neither a database URL", storage="optuna.db")
    refused(r"storage: 'sqlite://' is a database in memory", storage="sqlite://")
    # a key written twice: refused as in a run config, with both lines
    text = _sweep_file(tmp_path).read_text(encoding="utf-8").replace("trials: 16\n", "trials: 16\ntrials: 4\n")
    path = _sweep_file(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: duplicate key 'trials' on line 4 and line 5; keep one")):
        load_sweep(path)
    # values inside the space, each a valid config on the base, whose combination is not: the hunch is named, and
    # the flow's body stops there, before the deployment, the study or any run
    path = _sweep_file(tmp_path, space={"data.cleaning.min_words": {"type": "categorical", "choices": [1, 50]},
                                        "data.cleaning.max_words": {"type": "categorical", "choices": [250, 40]}},
                       enqueue=[{"data.cleaning.min_words": 50, "data.cleaning.max_words": 40}])
    started = []
    monkeypatch.setenv("AIAYN_CONFIG_DIRS", str(tmp_path))  # the flow takes sweep files from the allowed folders only
    monkeypatch.setattr(module, "get_run_logger", lambda: None)
    monkeypatch.setattr(module, "DeploymentRunner", lambda *a: started.append(a))
    monkeypatch.setattr(module, "open_study", lambda *a: started.append(a))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: enqueue[0] {{'data.cleaning.min_words': 50, "
                                                    "'data.cleaning.max_words': 40} makes an invalid config: ")
                       + ".*min_words \\(50\\) must not exceed max_words \\(40\\)"):
        module._run_sweep(str(path), None, None, None, None, True, "translation")
    assert not started, "something started before the sweep file was refused"


def test_a_storage_that_cannot_be_opened_names_the_field_and_what_to_write(tmp_path):
    """A storage: URL SQLAlchemy cannot open says so in one line naming the sweep file, the field, its value and what
    to write instead, not with SQLAlchemy's traceback (and it fails before the study exists)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = _sweep_file(tmp_path)
    for storage, why in (("foo://db", "Can't load plugin: sqlalchemy.dialects:foo"),
                         (f"sqlite:///{blocker}/optuna.db", "unable to open database file"),
                         (f"journal:{blocker}/journal.log", f"[Errno 17] File exists: '{blocker}'")):
        sweep = load_sweep(_sweep_file(tmp_path, storage=storage))
        with pytest.raises(ConfigError) as e:
            open_storage(sweep, tmp_path)
        assert str(e.value) == (f"{path}: storage = {storage!r} cannot be opened: {why}. Leave storage empty (SQLite "
                                "in the work dir), or give sqlite:///<file in a writable folder>, a database URL whose "
                                "server answers and whose driver is installed (postgresql://...), or journal:<file>")
    # the default, and a journal file whose folder does not exist yet, open
    assert open_storage(load_sweep(_sweep_file(tmp_path, storage="")), tmp_path).get_all_studies() == []
    assert open_storage(load_sweep(_sweep_file(tmp_path, storage=f"journal:{tmp_path}/new/j.log")), tmp_path)


def test_trials_and_max_in_flight_below_one_are_refused_not_replaced_by_the_files(tmp_path):
    """``-p trials=0`` / ``-p max_in_flight=0`` were taken as "not given" (the file's 16 and 1 ran instead): the
    flows' schema refuses them, so the server refuses the run when it is created (the deployment's schema) and the
    flow before its body; a sweep loaded with them names the parameter, not the file."""
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema

    import flows.sweep as module

    for flow in (module.sweep_translation, module.sweep_en_de, module.sweep_parse):
        properties = parameter_schema(flow.fn).model_dump_for_openapi()["properties"]
        for name in ("trials", "max_in_flight"):
            assert {"minimum": 1, "type": "integer"} in properties[name]["anyOf"], (flow.name, properties[name])
        with pytest.raises(ParameterTypeError, match=r"(?s)trials: Input should be greater than or equal to 1.*"
                                                     r"max_in_flight: Input should be greater than or equal to 1"):
            flow.validate_parameters({"trials": 0, "max_in_flight": 0})
        assert flow.validate_parameters({"trials": 1})["trials"] == 1
    with pytest.raises(ConfigError, match=r"^parameter max_in_flight=0: Input should be greater than or equal to 1$"):
        load_sweep("multi30k-cpu", {"max_in_flight": 0})


def test_a_run_cancelled_with_its_controller_is_resumed_by_the_next_and_one_cancelled_while_watched_is_over(tmp_path):
    """A sweep that fails cancels the runs it started (its hooks; Prefect does it for a cancelled one): the next
    controller resumes each by its next attempt instead of counting the trial failed. A run that ends CANCELLED while
    a controller watches it was cancelled on purpose (by hand): its trial is over."""
    sweep = _sweep(tmp_path, trials=2, max_in_flight=2, pruner={"kind": "none"})
    point = base_point(sweep, resolve_base(sweep))
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    runner = ScriptedRunner(points=3)

    def dies(run_id):
        raise RuntimeError("the controller fails at its first look")

    runner.curve, curve = dies, runner.curve
    with pytest.raises(RuntimeError, match="first look"):
        search(sweep, study, runner, lambda p: expand(sweep, p))
    assert len(runner.runs) == 2
    for run_id in list(runner.runs):  # what the sweep flow's hook does
        runner.cancel(run_id, "cancelled with its sweep controller")
    runner.curve = curve
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    search(sweep, study, runner, lambda p: expand(sweep, p))
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert [t.user_attrs["run_id"] for t in trials] == [runner.keys[run_key(study, f"trial-{t.number}-attempt-2")]
                                                        for t in trials]
    # watched: cancelled by hand after it started, the trial fails and nothing starts again for it
    class CancelledByHand(ScriptedRunner):
        def state(self, run_id):
            if self.runs[run_id]["looks"]:
                self.cancel(run_id, "by hand")
            return super().state(run_id)

    watched = CancelledByHand()
    study.enqueue_trial({"train.warmup_steps": 2000, "model": "wide"})
    search(_sweep(tmp_path, trials=3, max_in_flight=1, pruner={"kind": "none"}), study, watched,
           lambda p: expand(sweep, p))
    assert study.trials[2].state.name == "FAIL" and study.trials[2].user_attrs["run_state"] == "CANCELLED"
    assert len(watched.runs) == 1


class ScriptedRunner:
    """In place of the work pool: a run's dev curve grows by one point per look; warm-up sets how good it is. The
    run of each key ending in one of ``crash`` dies (CRASHED) at its second look; the next attempt resumes its
    curve, as the pipeline resumes a run's checkpoints."""

    def __init__(self, points: int = 6, crash: tuple[str, ...] = ()):
        self.crash = crash
        self.runs: dict[str, dict] = {}
        self.keys: dict[str, str] = {}
        self.points = points
        self.cancelled: list[str] = []
        self.max_active = 0

    def start(self, key, name, overrides):
        if key in self.keys:  # idempotent, like Prefect's idempotency keys
            return self.keys[key]
        run_id = f"run-{len(self.runs)}"
        self.keys[key] = run_id
        resumed = [r for r in self.runs.values() if r["overrides"] == overrides and r["state"] == "CRASHED"]
        looks = max((r["looks"] for r in resumed), default=0)
        self.runs[run_id] = {"overrides": overrides, "looks": looks, "from": looks, "state": "RUNNING",
                             "crash": key.endswith(self.crash) if self.crash else False}
        active = sum(r["state"] == "RUNNING" for r in self.runs.values())
        self.max_active = max(self.max_active, active)
        return run_id

    def _quality(self, run_id):  # lower warm-up and the wide model are better here
        o = self.runs[run_id]["overrides"]
        return o["train.warmup_steps"] / 1000 + (0 if o["model.d_model"] == 384 else 0.5)

    def state(self, run_id):
        run = self.runs[run_id]
        if run["state"] == "RUNNING":
            run["looks"] += 1
            if run["crash"] and run["looks"] == run["from"] + 2:
                run["state"] = "CRASHED"
            elif run["looks"] >= self.points:
                run["state"] = "COMPLETED"
        return run["state"]

    def curve(self, run_id):
        q = self._quality(run_id)
        return [(10.0 * (i + 1), 40 - i + 5 * q) for i in range(self.runs[run_id]["looks"])]

    def cancel(self, run_id, why):
        self.cancelled.append(run_id)
        self.runs[run_id]["state"] = "CANCELLED"

    def outcome(self, run_id):
        return Outcome("COMPLETED", {"multi30k-val.sacrebleu": 40 - 5 * self._quality(run_id)}, None, 100)


def test_search_runs_the_base_first_caps_runs_in_flight_prunes_and_resumes(tmp_path):
    sweep = _sweep(tmp_path, trials=6)
    point = base_point(sweep, resolve_base(sweep))
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    runner = ScriptedRunner()
    search(sweep, study, runner, lambda p: expand(sweep, p))
    trials = study.get_trials()
    assert len(trials) == 6 and trials[0].params == point and trials[0].user_attrs["base"]
    assert runner.max_active <= sweep.max_in_flight
    states = [t.state.name for t in trials]
    assert set(states) == {"COMPLETE", "PRUNED"}  # Hyperband stopped the trials behind at a rung
    # what was pruned was cancelled, and nothing else
    pruned = [t.user_attrs["run_id"] for t in trials if t.state.name == "PRUNED"]
    assert sorted(runner.cancelled) == sorted(pruned)
    # intermediate values: the negative dev NLL per sentence at each training second reported
    assert all(all(v < 0 for v in t.intermediate_values.values()) for t in trials)
    rows = leaderboard(study)
    assert rows[0]["value"] == max(t.value for t in trials if t.value is not None and t.state.name == "COMPLETE")
    # A second controller on the same storage: nothing runs again, and a larger budget goes on from there.
    again = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    search(sweep, again, runner, lambda p: expand(sweep, p))
    runs = len(runner.runs)
    assert len(again.get_trials()) == 6 and runs == len({tuple(t.params.values()) for t in trials})
    search(_sweep(tmp_path, trials=7), again, runner, lambda p: expand(sweep, p))
    assert len(again.get_trials()) == 7 and len(runner.runs) == runs + 1


def test_a_resumed_search_draws_new_points_and_a_point_drawn_twice_is_not_trained_again(tmp_path):
    sweep = _sweep(tmp_path, trials=2, max_in_flight=1)
    point = base_point(sweep, resolve_base(sweep))
    runner = ScriptedRunner()
    search(sweep, open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu"), runner, lambda p: expand(sweep, p))
    # a second controller goes on: its first draw is not the first draw of the controller before it
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    search(_sweep(tmp_path, trials=3, max_in_flight=1), study, runner, lambda p: expand(sweep, p))
    first, second = study.trials[1], study.trials[2]
    assert second.params != first.params and "duplicate_of" not in second.user_attrs
    # A space of two points: every draw after both are measured is a twin, recorded with its twin's result (state,
    # score, dev curve) and never started: a second run would resume from the first's checkpoints.
    small = _sweep(tmp_path, name="two", trials=6, max_in_flight=1, storage=f"sqlite:///{tmp_path / 'two.db'}",
                   space={"model": sweep.space["model"]})
    study = open_study(small, tmp_path, {"model": point["model"]}, "multi30k-val.sacrebleu")
    runner = ScriptedRunner()
    search(small, study, runner, lambda p: {**expand(small, p), "train.warmup_steps": 500})
    trials = study.get_trials()
    assert len(trials) == 6 and len(runner.runs) == len({t.params["model"] for t in trials}) == 2
    for t in trials:
        twin = trials[t.user_attrs.get("duplicate_of", t.number)]
        assert twin.number < t.number or twin is t
        assert (t.state, t.value, t.intermediate_values, t.user_attrs["run_id"]) == \
            (twin.state, twin.value, twin.intermediate_values, twin.user_attrs["run_id"])
    rows = leaderboard(study)
    assert sorted(r["duplicate_of"] is None for r in rows) == [False] * 4 + [True] * 2
    assert "(= " in markdown(small, rows, [], [], None, "multi30k-val.sacrebleu")


def test_an_enqueued_hunch_trains_its_whole_budget_though_behind_at_every_rung(tmp_path):
    hunch = {"train.warmup_steps": 2000, "model": "small"}  # the worst point of the scripted runner
    sweep = _sweep(tmp_path, trials=2, max_in_flight=1, enqueue=[hunch],  # one Hyperband bracket: base and hunch meet
                   pruner={"min_resource_s": 10, "max_resource_s": 20, "reduction_factor": 3})
    study = open_study(sweep, tmp_path, base_point(sweep, resolve_base(sweep)), "multi30k-val.sacrebleu")
    runner = ScriptedRunner()
    search(sweep, study, runner, lambda p: expand(sweep, p))
    base, tried = study.get_trials()
    assert tried.params == hunch and all(tried.intermediate_values[s] < v for s, v in base.intermediate_values.items())
    # behind the base at every rung, it is neither pruned nor cancelled: a drawn point so far behind would be
    assert tried.state.name == "COMPLETE" and not runner.cancelled and len(tried.intermediate_values) == runner.points


def test_a_hunch_is_the_base_with_its_values_and_never_a_draw_in_the_dimensions_it_leaves_out(tmp_path):
    sweep = _sweep(tmp_path, trials=2, max_in_flight=1, enqueue=[{"model": "wide"}])
    point = base_point(sweep, resolve_base(sweep))
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    # a study that queued the hunch as Optuna takes it (the left-out warm-up would be drawn): replaced, not run
    study.enqueue_trial({"model": "wide"})
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    runner = ScriptedRunner()
    search(sweep, study, runner, lambda p: expand(sweep, p))
    measured = [t for t in study.get_trials() if "withdrawn" not in t.user_attrs]
    assert [t.params for t in measured] == [point, {**point, "model": "wide"}]
    assert [r["overrides"]["train.warmup_steps"] for r in runner.runs.values()] == [point["train.warmup_steps"]] * 2
    (old,) = [t for t in study.get_trials() if "withdrawn" in t.user_attrs]
    assert old.system_attrs["fixed_params"] == {"model": "wide"} and not old.params


def _fixed(tmp_path: Path, **over) -> SweepConfig:
    """A study of fixed arms over the test space: the base and three arms, no pruner and no top_k written."""
    tree = {k: v for k, v in _tree(tmp_path).items() if k not in ("pruner", "trials")}
    arms_ = [{"model": "wide"}, {"train.warmup_steps": 1500}, {"train.warmup_steps": 2000, "model": "wide"}]
    return SweepConfig.model_validate({**tree, "fixed_arms": True, "enqueue": arms_, "max_in_flight": 1,
                                       "confirm": {"seeds": [1, 2], "resamples": 200}, **over})


def test_a_study_of_fixed_arms_runs_the_base_and_its_arms_only_and_confirms_every_one(tmp_path):
    """``fixed_arms``: the trials are the base and the enqueued arms (trials defaults to their count and may not
    exceed it, so TPE never draws), none is pruned though behind at every rung, and every completed arm is
    confirmed against the base (not the top_k best), with the Bonferroni threshold over all of them."""
    sweep = _fixed(tmp_path)
    assert sweep.trials == 4
    with pytest.raises(ValueError, match=r"trials = 5 with fixed_arms: the study has the base and 3 arm\(s\)"):
        _fixed(tmp_path, trials=5)
    with pytest.raises(ValueError, match=r"\['confirm.top_k', 'pruner'\] do not apply to fixed_arms"):
        _fixed(tmp_path, pruner={"kind": "hyperband"}, confirm={"top_k": 1})
    with pytest.raises(ValueError, match="fixed_arms needs its arms: list them under enqueue"):
        _fixed(tmp_path, enqueue=[])
    # a window of machine time runs the first trials only (the flow's -p trials=2), the next goes on
    point = base_point(sweep, resolve_base(sweep))
    runner = ScriptedRunner()
    study = open_study(_fixed(tmp_path, trials=2), tmp_path, point, "multi30k-val.sacrebleu")
    search(_fixed(tmp_path, trials=2), study, runner, lambda p: expand(sweep, p))
    ran = [t for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert [t.params for t in ran] == [point, {**point, "model": "wide"}] and len(runner.runs) == 2
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    search(sweep, study, runner, lambda p: expand(sweep, p))
    trials = study.get_trials()
    assert [t.params for t in trials] == [point, *({**point, **arm} for arm in sweep.enqueue)]
    # the worst arm (warm-up 2000 trails the base at every look) trained its whole budget, as every other did
    assert all(t.state.name == "COMPLETE" and len(t.intermediate_values) == runner.points for t in trials)
    assert not runner.cancelled and len(runner.runs) == 4
    base, *candidates = arms(sweep, study, point)
    assert base.label == "base" and sorted(a.trial for a in candidates) == [1, 2, 3]  # top_k (1) is not used
    done = confirm(sweep, study, runner, [base, *candidates], lambda p: expand(sweep, p))
    assert all(sorted(a.outcomes) == [1, 2] for a in done)
    for arm in done:  # each seed's outputs, with the worse arms' the more words dropped
        for seed in (1, 2):
            drop = 0.3 if arm.label == "base" else 0.05 if arm.trial == 1 else 0.3
            out = _outputs(tmp_path / f"{arm.label}-{seed}", drop, 10 * (arm.trial or 0) + seed)
            arm.outcomes[seed] = Outcome("COMPLETED", {**arm.outcomes[seed].metrics}, out, 100)
    verdicts = judge(sweep, done, "dev", "multi30k-val.sacrebleu", "sacrebleu")
    assert len(verdicts) == 3 and all(v.threshold == pytest.approx(0.05 / 3) for v in verdicts)
    assert winner(done, verdicts).trial == 1


def test_hunches_follow_the_sweep_file_added_ones_join_and_a_waiting_one_taken_out_is_withdrawn(tmp_path):
    one, two, three = ({"train.warmup_steps": w, "model": "wide"} for w in (500, 600, 700))
    point = base_point(_sweep(tmp_path), resolve_base(_sweep(tmp_path)))
    open_study(_sweep(tmp_path, enqueue=[one, two]), tmp_path, point, "multi30k-val.sacrebleu")
    # the file changes before the search starts: hunch one is taken out, three is added (two stays, queued once)
    sweep = _sweep(tmp_path, trials=3, max_in_flight=1, enqueue=[two, three])
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    search(sweep, study, ScriptedRunner(), lambda p: expand(sweep, p))
    trials = study.get_trials()
    withdrawn = [t for t in trials if "withdrawn" in t.user_attrs]
    assert [t.system_attrs["fixed_params"] for t in withdrawn] == [one] and withdrawn[0].state.name == "FAIL"
    measured = [t for t in trials if t not in withdrawn]
    assert [t.params for t in measured] == [point, two, three]  # three trials measured: the withdrawn one is not one
    assert all(t.state.name == "COMPLETE" for t in measured)
    rows = leaderboard(study)
    assert next(r for r in rows if r["trial"] == withdrawn[0].number)["params"] == one
    assert "FAIL (taken out of enqueue before it ran)" in markdown(sweep, rows, [], [], None, "multi30k-val.sacrebleu")
    open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")  # again: nothing new is queued
    assert len(study.get_trials()) == len(trials)


def test_a_dimension_added_to_a_running_study_is_the_base_value_in_the_trials_before_it(tmp_path):
    sweep = _sweep(tmp_path, trials=2, max_in_flight=1)
    runner = ScriptedRunner()
    search(sweep, open_study(sweep, tmp_path, base_point(sweep, resolve_base(sweep)), "multi30k-val.sacrebleu"),
           runner, lambda p: expand(sweep, p))
    # The file gains label smoothing; trials 0 and 1 ran at the base config's 0.1. A hunch of trial 1's point at
    # 0.1 is trial 1 again (recorded, not run); the confirmation still finds the base among the trials.
    ls = {"type": "categorical", "choices": [0.1, 0.2]}
    grown = _sweep(tmp_path, trials=3, max_in_flight=1, space={**sweep.space, "train.label_smoothing": ls})
    point = base_point(grown, resolve_base(grown))
    assert point["train.label_smoothing"] == 0.1
    study = open_study(grown, tmp_path, point, "multi30k-val.sacrebleu")
    hunch = {**study.trials[1].params, "train.label_smoothing": 0.1}
    grown = grown.model_copy(update={"enqueue": [hunch]})
    study = open_study(grown, tmp_path, point, "multi30k-val.sacrebleu")
    search(grown, study, runner, lambda p: expand(grown, p))
    assert len(runner.runs) == 2 and study.trials[2].user_attrs["duplicate_of"] == 1
    base, *candidates = arms(grown, study, point)
    assert base.search_value == study.trials[0].value and [a.params for a in candidates] == [hunch]
    assert [r["params"]["train.label_smoothing"] for r in leaderboard(study)] == [0.1] * 3


def test_the_report_writes_stepped_floats_as_a_reader_would(tmp_path):
    sweep = _sweep(tmp_path, space={"train.label_smoothing": {"type": "float", "low": 0.0, "high": 0.2, "step": 0.05}})
    row = {"trial": 1, "state": "COMPLETE", "value": 40.0, "params": {"train.label_smoothing": 0.15000000000000002},
           "base": False, "steps": 10, "dev_sentence_nll": 30.0, "train_seconds": 100, "run_id": "r",
           "duplicate_of": None}
    assert "| 0.15 |" in markdown(sweep, [row], [], [], None, "multi30k-val.sacrebleu")


def _outputs(folder: Path, drop: float, seed: int) -> Path:
    """An evaluation folder whose dev hypotheses drop each word with probability ``drop``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    hyps = [" ".join(w for w in r.split() if rng.random() > drop) for r in REFS]
    (folder / "dev.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    (folder / "dev.ref").write_text("".join(r + "\n" for r in REFS), encoding="utf-8")
    return folder


def test_pooled_bootstrap_is_sacrebleus_paired_bootstrap_for_one_seed(tmp_path):
    a = _outputs(tmp_path / "a", 0.20, 1).joinpath("dev.hyp").read_text().split("\n")[:-1]
    b = _outputs(tmp_path / "b", 0.18, 2).joinpath("dev.hyp").read_text().split("\n")[:-1]
    one, pooled = paired_bootstrap("sacrebleu", a, b, REFS, 300), pooled_bootstrap("sacrebleu", [a], [b], REFS, 300)
    assert 0.001 < one.p_value < 1 and pooled.p_value == pytest.approx(one.p_value)
    assert (pooled.delta, pooled.ci_low, pooled.ci_high) == (one.delta, one.ci_low, one.ci_high)
    assert pooled_bootstrap("sacrebleu", [a, b], [a, b], REFS, 300).p_value == 1.0
    with pytest.raises(ValueError, match="same number of runs"):
        pooled_bootstrap("sacrebleu", [a], [a, b], REFS)


def test_confirmation_verdicts_are_bonferroni_corrected_and_the_winner_is_a_preset(tmp_path):
    sweep = _sweep(tmp_path, confirm={"top_k": 2, "seeds": [1, 2, 3], "alpha": 0.05, "resamples": 300})
    base = {"train.warmup_steps": 1000, "model": "small"}
    arms_ = [Arm("base", base, None, 30.0), Arm("trial-1", {"train.warmup_steps": 500, "model": "wide"}, 1, 35.0),
             Arm("trial-2", {"train.warmup_steps": 750, "model": "small"}, 2, 31.0)]
    for k, (arm, drop) in enumerate(zip(arms_, (0.3, 0.05, 0.29))):
        for seed in sweep.confirm.seeds:
            out = _outputs(tmp_path / f"{arm.label}-{seed}", drop, 10 * k + seed)
            hyps = out.joinpath("dev.hyp").read_text().split("\n")[:-1]
            score = pooled_bootstrap("sacrebleu", [hyps], [hyps], REFS, 100).challenger
            arm.outcomes[seed] = Outcome("COMPLETED", {"multi30k-val.sacrebleu": score}, out, 100)
    verdicts = judge(sweep, arms_, "dev", "multi30k-val.sacrebleu", "sacrebleu")
    assert [v.label for v in verdicts] == ["trial-1", "trial-2"]
    assert all(v.threshold == pytest.approx(0.025) and v.seeds == [1, 2, 3] for v in verdicts)
    clear, tie = verdicts
    assert clear.verdict == "better" and clear.comparison.p_value < 0.025 and clear.mean > clear.base_mean
    assert tie.verdict == "no significant difference" and tie.std > 0
    chosen = winner(arms_, verdicts)
    assert chosen.label == "trial-1"
    path = write_winner(sweep, chosen, verdicts, [], tmp_path / "winner.yaml", resolve_base(sweep))
    text = path.read_text()
    assert "# dev: " in text and "better" in text and "export.engine" not in text
    cfg = load_config(path)  # the preset loads: the base with the winning values
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.warmup_steps) == (384, 6, 500)
    # a sweep whose trials ran under the fp32 recipe: the winner keeps the recipe's settings under its own values
    # and trains them on every machine (the recipe does not apply again over the winning values)
    fp32 = write_winner(sweep, chosen, verdicts, [], tmp_path / "fp32.yaml", load_config(sweep.base, ["recipe=fp32"]))
    cfg = load_config(fp32)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.update_tokens, cfg.train.cooldown) == (384, 6, 2048, 0.3)
    assert cfg.recipe_applied is None or cfg.recipe_applied == "none"
    assert cfg.name == "multi30k-cpu-t" and yaml.safe_load(text)["extends"] == ["multi30k-cpu"]
    # nothing significant: the base stays, and its preset changes nothing
    assert winner(arms_, [tie]).label == "base"
    assert json.dumps(clear.as_dict())  # the confirmation table is JSON


def test_confirm_reuses_runs_by_key_and_keeps_failures_apart(tmp_path):
    sweep = _sweep(tmp_path, trials=3, pruner={"kind": "none"})
    point = base_point(sweep, resolve_base(sweep))
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    runner = ScriptedRunner(points=2)
    search(sweep, study, runner, lambda p: expand(sweep, p))
    candidates = arms(sweep, study, point)
    assert candidates[0].label == "base" and len(candidates) == 2 and candidates[1].params != point
    done = confirm(sweep, study, runner, candidates, lambda p: expand(sweep, p))
    assert all(sorted(a.outcomes) == [1, 2] for a in done)
    assert {r["overrides"]["train.seed"] for r in runner.runs.values() if "train.seed" in r["overrides"]} == {1, 2}
    n = len(runner.runs)
    confirm(sweep, study, runner, arms(sweep, study, point), lambda p: expand(sweep, p))
    assert len(runner.runs) == n  # the same keys: the runs it started before


def test_a_crashed_run_is_resumed_by_its_next_attempt_and_a_restarted_controller_finds_it(tmp_path):
    sweep = _sweep(tmp_path, trials=2, max_in_flight=1, pruner={"kind": "none"},
                   confirm={"top_k": 1, "seeds": [1, 2], "resamples": 200})
    point = base_point(sweep, resolve_base(sweep))
    study = open_study(sweep, tmp_path, point, "multi30k-val.sacrebleu")
    runner = ScriptedRunner(points=4, crash=("trial-1", "confirm-base-seed-2"))
    search(sweep, study, runner, lambda p: expand(sweep, p))
    trial = study.trials[1]
    again = runner.keys[run_key(study, "trial-1-attempt-2")]
    assert trial.state.name == "COMPLETE" and trial.user_attrs["run_id"] == again
    assert runner.runs[runner.keys[run_key(study, "trial-1")]]["state"] == "CRASHED"
    assert sorted(trial.intermediate_values) == [10, 20, 30, 40]  # one curve across both runs
    done = confirm(sweep, study, runner, arms(sweep, study, point), lambda p: expand(sweep, p))
    base = next(a for a in done if a.label == "base")
    assert base.outcomes[2].state == "COMPLETED"
    assert base.runs[2] == runner.keys[run_key(study, "confirm-base-seed-2-attempt-2")]
    # A controller started again walks the same keys to the same runs: nothing new starts.
    n = len(runner.runs)
    confirm(sweep, study, runner, arms(sweep, study, point), lambda p: expand(sweep, p))
    assert len(runner.runs) == n
    # A run that crashes at every attempt fails its trial after ATTEMPTS runs.
    always = ScriptedRunner(points=20, crash=tuple(f"trial-2{s}" for s in ("", "-attempt-2", "-attempt-3")))
    new_point = next(p for p in ({"train.warmup_steps": w, "model": "wide"} for w in (2000, 1950))
                     if p not in [t.params for t in study.trials])
    study.enqueue_trial(new_point)  # a point of its own: a twin of an earlier trial would not run
    search(_sweep(tmp_path, trials=3, max_in_flight=1, pruner={"kind": "none"}), study, always,
           lambda p: expand(sweep, p))
    assert study.trials[2].state.name == "FAIL" and study.trials[2].user_attrs["run_state"] == "CRASHED"
    assert len(always.runs) == ATTEMPTS


# ------------------------------------------------------------------------------------------- on the local stack


def test_the_optuna_adapter_holds_on_the_installed_optuna():
    """Every function of pipeline/sweep/optuna_adapter.py (the only code that uses Optuna's private API) against a
    real in-memory study, by its observable effect: an Optuna that changes those internals fails here, loudly."""
    import optuna
    from optuna.distributions import IntDistribution
    from optuna.trial import TrialState

    from pipeline.sweep import optuna_adapter as adapter

    space = {"x": IntDistribution(0, 9)}
    try:
        study = optuna.create_study(direction="maximize")  # in memory
        study.enqueue_trial({"x": 1})
        study.enqueue_trial({"x": 2})
        first, second = study.get_trials(states=(TrialState.WAITING,))
        assert adapter.enqueued_params(first) == {"x": 1}, "enqueued_params: the enqueued point"
        # withdraw the second waiting trial: a user attribute and FAIL, without asking for it
        adapter.set_user_attr(study, second, "withdrawn", "taken out")
        adapter.set_trial_state(study, second, TrialState.FAIL)
        stored = study.get_trials()[1]
        assert (stored.state, stored.value, stored.user_attrs) == (TrialState.FAIL, None, {"withdrawn": "taken out"}), (
            "set_user_attr / set_trial_state on a WAITING trial")
        # a live trial's stored state: its reports so far and its enqueued point
        asked = study.ask(space)
        assert (asked.number, asked.params) == (0, {"x": 1})
        asked.report(0.5, 3)
        frozen = adapter.frozen_trial(study, asked)
        assert (frozen.number, frozen.state, frozen.intermediate_values) == (0, TrialState.RUNNING, {3: 0.5}), (
            "frozen_trial: what storage holds for a live trial")
        assert adapter.enqueued_params(frozen) == {"x": 1}
        drawn = study.ask(space)  # the withdrawn one is not asked for again: a drawn trial comes next
        assert drawn.number == 2 and adapter.enqueued_params(adapter.frozen_trial(study, drawn)) is None, (
            "a withdrawn trial was asked for, or enqueued_params is not None for a drawn trial")
        # a restarted controller: a live trial again for the stored RUNNING one, reported to and told
        again = adapter.trial_for(study, frozen)
        assert (again.number, again.params) == (0, {"x": 1}), "trial_for: the live trial of a stored one"
        again.report(0.7, 4)
        again.set_user_attr("run_id", "run-0")
        study.tell(again, 0.9)
        done = study.get_trials()[0]
        assert (done.state, done.value, done.intermediate_values, done.user_attrs) == (
            TrialState.COMPLETE, 0.9, {3: 0.5, 4: 0.7}, {"run_id": "run-0"}), "trial_for: report and tell"
    except Exception as e:  # an AttributeError, TypeError, KeyError or a wrong effect: all the same to a reader
        pytest.fail(f"Optuna's private API changed: see pipeline/sweep/optuna_adapter.py (the one place that uses "
                    f"it); the tested versions are optuna{adapter.TESTED}, this is optuna {optuna.__version__}: "
                    f"{type(e).__name__}: {e}")


def test_optuna_is_bounded_to_the_versions_the_adapter_is_tested_on():
    """pyproject.toml's bound on Optuna is the adapter's TESTED, and the installed Optuna is inside it."""
    import tomllib

    import optuna
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from pipeline.sweep.optuna_adapter import TESTED

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    (req,) = [Requirement(d) for d in project["project"]["dependencies"] if Requirement(d).name == "optuna"]
    assert req.specifier == SpecifierSet(TESTED), f"pyproject.toml bounds {req}; the adapter is tested on {TESTED}"
    assert optuna.__version__ in SpecifierSet(TESTED), (
        f"optuna {optuna.__version__} is installed, the adapter (pipeline/sweep/optuna_adapter.py) is tested on "
        f"{TESTED}: run test_the_optuna_adapter_holds_on_the_installed_optuna, then move TESTED and the bound")


def test_sweep_translation_is_the_flow_and_sweep_en_de_its_former_name_kept(monkeypatch):
    """One body, two names: ``sweep-translation`` and ``sweep-en-de`` (kept for compatibility; it says so in its
    log) take the same parameters and run the same body, and prefect.yaml deploys both alike as multi30k-cpu."""
    import inspect
    from types import SimpleNamespace

    import flows.sweep as module

    assert (module.sweep_translation.name, module.sweep_en_de.name) == ("sweep-translation", "sweep-en-de")
    assert inspect.signature(module.sweep_en_de.fn) == inspect.signature(module.sweep_translation.fn)
    calls, said = [], []
    monkeypatch.setattr(module, "_run_sweep", lambda *args: calls.append(args) or {"winner": None})
    monkeypatch.setattr(module, "get_run_logger", lambda: SimpleNamespace(info=lambda msg, *a: said.append(msg % a)))
    assert module.sweep_translation.fn("s.yaml", None, 3, 1, None, False) == {"winner": None}
    assert not said
    assert module.sweep_en_de.fn("s.yaml", None, 3, 1, None, False) == {"winner": None}
    assert calls == [("s.yaml", None, 3, 1, None, False, "translation")] * 2
    assert len(said) == 1 and "kept for compatibility" in said[0] and "sweep-translation/multi30k-cpu" in said[0]
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "prefect.yaml").read_text(encoding="utf-8"))
    deployed = {d["entrypoint"]: d for d in spec["deployments"] if d["entrypoint"].startswith("flows/sweep.py:")}
    new, old = deployed.pop("flows/sweep.py:sweep_translation"), deployed.pop("flows/sweep.py:sweep_en_de")
    parse = deployed.pop("flows/sweep.py:sweep_parse")  # the parser's study (tests/test_sweep_parsing.py)
    assert not deployed and new["name"] == old["name"] == "multi30k-cpu"
    assert parse["parameters"] == {"sweep": "ptb-sample-cpu"}
    same = {"name", "parameters", "work_pool", "concurrency_limit", "schedules", "tags"}  # all but what says which
    assert set(new) == set(old) and {k: new[k] for k in same & set(new)} == {k: old[k] for k in same & set(old)}
    assert set(new) - same == {"entrypoint", "description"}


@pytest.mark.slow
@pytest.mark.integration
def test_sweep_deployment_prunes_confirms_and_resumes(stack, tmp_path):
    """``sweep-translation`` on the real stack: its trials are ``train-en-de`` flow runs on the work pool (subflows,
    keyed), the one that learns nothing is pruned on its dev NLL and its run cancelled, the best is confirmed with
    paired seeds, and the sweep's artifacts, MLflow runs and winner preset exist. Run first with confirm=false
    (the search only), then whole (it goes on to confirm), then again under the flow's former name (``sweep-en-de``,
    kept for compatibility): the same sweep, so it starts no run."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import QUICK

    alpha = load_config("multi30k-cpu-hub").decode.length_penalty  # the base must be a point of the space
    sweep = {"name": "itest", "base": "multi30k-cpu-hub", "deployment": "train-en-de/multi30k-cpu", "trials": 3,
             "max_in_flight": 1, "poll_s": 1,
             # long enough in seconds for the pruner to look (training seconds are its resource), short in BLEU
             "trial_overrides": {**QUICK, "train.max_steps": 100000, "train.max_minutes": 0.25,
                                 "train.dev_every_steps": 10, "train.checkpoint_every_steps": 50,
                                 "average.last_n": 1, "export.engine": "none", "tracking.attention_sentences": 0},
             # trial 1 (enqueued) trains as the base (its training comes from the cache) and decodes with another
             # length penalty; trial 2 is TPE's first draw, which with seed 1 is lr x0.001: it learns nothing and,
             # drawn rather than enqueued (a hunch trains its whole budget), is pruned
             "space": {"train.lr_scale": {"type": "categorical", "choices": [1.0, 0.001]},
                       "decode.length_penalty": {"type": "categorical", "choices": [alpha, 0.6]}},
             "seed": 1, "enqueue": [{"train.lr_scale": 1.0, "decode.length_penalty": 0.6}],
             "pruner": {"min_resource_s": 4, "max_resource_s": 8, "reduction_factor": 3},  # one bracket
             "confirm": {"top_k": 1, "seeds": [1, 2], "resamples": 200}}
    path = tmp_path / "itest.yaml"
    path.write_text(yaml.safe_dump(sweep), encoding="utf-8")
    prefect = stack["prefect"]
    # First the search alone (confirm=false), as a long sweep is spread over windows of machine time
    status, out, searched = prefect.run_deployment("sweep-translation/multi30k-cpu",
                                                   {"sweep": str(path), "confirm": False}, timeout=900)
    assert status == 0, out[-4000:] + prefect.logs(searched)[-6000:]
    assert not [r for r in _api_runs(prefect, searched) if "-confirm-" in r["name"]]
    keys = {a["key"]: a for a in prefect.artifacts(searched)}
    assert "Confirmation: not run yet" in keys["sweep-itest-report"]["data"]
    assert not (stack["home"] / "work" / "sweeps" / "itest" / "winner.yaml").exists()
    # then the whole sweep: it goes on from the finished trials (found by their keys) to the confirmation
    status, out, run_id = prefect.run_deployment("sweep-translation/multi30k-cpu", {"sweep": str(path)}, timeout=900)
    assert status == 0, out[-4000:] + prefect.logs(run_id)[-6000:]
    children = _api_runs(prefect, searched) + _api_runs(prefect, run_id)
    trials = {r["name"]: r for r in children}
    assert trials["itest-trial-0"]["state"]["type"] == "COMPLETED"
    assert re.search(r"trial 2: run \S+ with \{.*'train.lr_scale': 0.001", prefect.logs(searched))
    assert trials["itest-trial-2"]["state"]["type"] == "CANCELLED"  # lr x0.001 learns nothing: pruned
    assert re.search(r"trial 2 pruned at \d+ s \(dev NLL/sentence", prefect.logs(searched))
    assert all(r["idempotency_key"].startswith("sweep-itest-") for r in children)
    assert all(r["parameters"]["register_model"] is False for r in children)
    assert trials["itest-trial-1"]["state"]["type"] == "COMPLETED"
    confirmations = sorted(n for n in trials if "-confirm-" in n)
    assert confirmations == ["itest-confirm-base-seed-1", "itest-confirm-base-seed-2", "itest-confirm-trial-1-seed-1",
                             "itest-confirm-trial-1-seed-2"]
    assert all(trials[n]["state"]["type"] == "COMPLETED" for n in confirmations)
    keys = {a["key"]: a for a in prefect.artifacts(run_id)}
    assert keys["sweep-itest-leaderboard"]["type"] == "table"
    report = keys["sweep-itest-report"]["data"]
    assert "| 2 | PRUNED |" in report and "| 0 (base) | COMPLETE |" in report and "| 1 | COMPLETE |" in report
    assert "| trial-1 | dev | 2 |" in report and "**Winner: " in report
    (dev,) = [v for v in json.loads((stack["home"] / "work" / "sweeps" / "itest" / "confirmation.json").read_text())
              if v["split"] == "dev"]
    assert dev["seeds"] == [1, 2] and dev["threshold"] == 0.05 and dev["comparison"]["segments"] == 2 * 1014
    winner = yaml.safe_load((stack["home"] / "work" / "sweeps" / "itest" / "winner.yaml").read_text())
    assert winner["extends"] == ["multi30k-cpu-hub"]
    # MLflow: the sweep's parent run with a child per trial and per confirmation run, the files as artifacts
    mlflow = MlflowClient(stack["mlflow"])
    exp = mlflow.get_experiment_by_name("aiayn")
    (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
    assert parent.info.status == "FINISHED" and parent.data.tags["winner"]
    runs = mlflow.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    names = {r.info.run_name for r in runs}
    assert {"trial-0", "trial-1", "trial-2", "confirm-base-seed-1", "confirm-base-seed-2"} <= names
    pruned = next(r for r in runs if r.info.run_name == "trial-2")
    assert pruned.data.tags["state"] == "PRUNED" and mlflow.get_metric_history(pruned.info.run_id, "dev_sentence_nll")
    assert {a.path for a in mlflow.list_artifacts(parent.info.run_id, "sweep")} >= {
        "sweep/leaderboard.json", "sweep/report.md", "sweep/winner.yaml", "sweep/confirmation.json"}

    # Again, by the former name: the study is done and every confirmation run is found by its key; nothing new runs.
    status, out, again = prefect.run_deployment("sweep-en-de/multi30k-cpu", {"sweep": str(path)}, timeout=600)
    assert status == 0, out[-2000:] + prefect.logs(again)[-6000:]
    assert "kept for compatibility" in prefect.logs(again) and "sweep-translation/multi30k-cpu" in prefect.logs(again)
    assert {r["id"] for r in _api_runs(prefect, again)} <= {r["id"] for r in children}
    total = prefect_runs_tagged(prefect, "sweep:itest")
    assert len(total) == len(children)


@pytest.mark.slow
@pytest.mark.integration
def test_a_deployment_applied_before_a_field_existed_fails_the_sweep_before_anything_starts(stack, tmp_path):
    """A deployment's parameter schema is the code's as of when it was applied: one applied before
    ``train.cooldown`` existed makes the server refuse the first trial that sends it (409, "Additional properties
    are not allowed"). The sweep checks every field and value its runs would send against the deployment first
    and fails naming the dimension and the fix, before any trial run, study or MLflow run exists."""
    import copy

    from tests.conftest import api

    prefect = stack["prefect"]
    (current,) = api(prefect.api, "/deployments/filter", {"flows": {"name": {"any_": ["train-en-de"]}},
                                                           "deployments": {"name": {"any_": ["multi30k-cpu"]}}})
    schema = copy.deepcopy(current["parameter_openapi_schema"])
    defs = schema.get("definitions") or schema["$defs"]
    del defs["FlowOverrides"]["properties"]["train.cooldown"]  # as applied before the field was added
    api(prefect.api, "/deployments/", {"name": "before-cooldown", "flow_id": current["flow_id"],
                                       "entrypoint": current["entrypoint"], "work_pool_name": current["work_pool_name"],
                                       "parameter_openapi_schema": schema, "enforce_parameter_schema": True})
    sweep = {"name": "stale", "base": "multi30k-cpu-hub", "deployment": "train-en-de/before-cooldown", "trials": 2,
             "trial_overrides": {"export.engine": "none"},
             "space": {"train.warmup_steps": {"type": "categorical", "choices": [1000, 500]},
                       "train.cooldown": {"type": "categorical", "choices": [0.0, 0.3]}}}
    path = tmp_path / "stale.yaml"
    path.write_text(yaml.safe_dump(sweep), encoding="utf-8")
    status, out, run_id = prefect.run_deployment("sweep-translation/multi30k-cpu", {"sweep": str(path)}, timeout=300)
    logs = prefect.logs(run_id)
    assert status != 0 and prefect.flow_run(run_id)["state"]["type"] == "FAILED", out[-3000:]
    assert re.search(r"deployment 'train-en-de/before-cooldown' refuses the parameters of space\.train\.cooldown = "
                     r"0\.0: .*'train\.cooldown' was unexpected.*apply the deployments again \(`\.venv/bin/python -m "
                     r"ops\.localstack up`", logs), logs[-3000:]
    assert _api_runs(prefect, run_id) == [] and not prefect_runs_tagged(prefect, "sweep:stale")
    assert not (stack["home"] / "work" / "sweeps" / "stale").exists()  # no study, no leaderboard


def _idle_deployment(prefect) -> str:
    """A copy of ``train-en-de/multi30k-cpu`` on a work pool no worker serves: its runs stay scheduled, a trial that
    never finishes (and never trains on the test machine). Returns its ``<flow>/<deployment>`` name."""
    import uuid

    from tests.conftest import api

    (current,) = api(prefect.api, "/deployments/filter", {"flows": {"name": {"any_": ["train-en-de"]}},
                                                           "deployments": {"name": {"any_": ["multi30k-cpu"]}}})
    name = f"idle-{uuid.uuid4().hex[:8]}"
    api(prefect.api, "/work_pools/", {"name": name, "type": "process"})
    api(prefect.api, "/deployments/", {"name": name, "flow_id": current["flow_id"], "entrypoint": current["entrypoint"],
                                       "work_pool_name": name, "enforce_parameter_schema": True,
                                       "parameter_openapi_schema": current["parameter_openapi_schema"]})
    return f"train-en-de/{name}"


def _two_trials(tmp_path: Path, name: str, deployment: str) -> Path:
    """A sweep of two trials at once (the base and a hunch) on ``deployment``, in an MLflow experiment of its own."""
    sweep = {"name": name, "base": "multi30k-cpu-hub", "deployment": deployment, "trials": 2, "max_in_flight": 2,
             "poll_s": 1, "trial_overrides": {"export.engine": "none", "tracking.experiment": name},
             "space": {"train.lr_scale": {"type": "categorical", "choices": [1.0, 1.5]}},
             "enqueue": [{"train.lr_scale": 1.5}], "pruner": {"kind": "none"}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sweep), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.integration
def test_a_sweep_that_crashes_or_fails_cancels_the_trials_it_started_and_ends_its_mlflow_run(stack, shared_data,
                                                                                             tmp_path, monkeypatch):
    """A sweep's controller that dies leaves no trial training without it and no MLflow run RUNNING: killed (SIGKILL
    of its flow-run process: the worker's on_crashed hooks), its trial runs end CANCELLED and its MLflow run KILLED;
    failed (an exception in the controller after its trials started: on_failure, in its own process), they end
    CANCELLED and FAILED. The trials are runs of a deployment no worker serves: they never finish."""
    import uuid

    from mlflow.tracking import MlflowClient
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import flows.sweep as module
    from tasks.sweep import DeploymentRunner
    from tests.test_crash import _flow_run_process, _wait

    prefect, mlflow = stack["prefect"], MlflowClient(stack["mlflow"])
    idle = _idle_deployment(prefect)

    def ended(name: str, flow_run_id: str, status: str) -> None:
        """The sweep's MLflow run ends ``status`` and every trial run it started ends CANCELLED."""
        trials = _wait("the sweep's two trial runs", lambda: len(_api_runs(prefect, flow_run_id)) == 2 and
                       _api_runs(prefect, flow_run_id), 60)
        assert all(f"sweep:{name}" in r["tags"] for r in trials)
        _wait("its trial runs to be cancelled", lambda: {r["state"]["type"] for r in _api_runs(prefect, flow_run_id)}
              == {"CANCELLED"}, 60)
        exp = mlflow.get_experiment_by_name(name)
        (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
        _wait(f"its MLflow run to end {status}", lambda: mlflow.get_run(parent.info.run_id).info.status == status, 60)
        _wait("the hook's word in the sweep's logs", lambda: re.search(
            rf"cancelled the 2 run\(s\) it had started that were not over: {name}-trial-[01], {name}-trial-[01]",
            prefect.logs(flow_run_id)), 30)

    # Crashed: its process killed once both trials are scheduled
    crashed = f"crashed-{uuid.uuid4().hex[:6]}"
    run_id = prefect.start_deployment("sweep-translation/multi30k-cpu",
                                      {"sweep": str(_two_trials(tmp_path, crashed, idle))})
    _wait("the sweep to start its two trial runs", lambda: len(_api_runs(prefect, run_id)) == 2, 180)
    engine = _flow_run_process(stack["services"]["prefect-worker"].pid, run_id)
    assert engine is not None, "no flow-run process under the worker"
    engine.kill()
    _wait("Prefect to mark the sweep CRASHED", lambda: prefect.flow_run(run_id)["state"]["type"] == "CRASHED", 60)
    ended(crashed, run_id, "KILLED")

    # Failed: the controller raises at its first look at its trials (in this process, against the same servers)
    failed = f"failed-{uuid.uuid4().hex[:6]}"

    def look_fails(self, run_id):
        raise RuntimeError("the controller fails after its trials started")

    monkeypatch.setattr(DeploymentRunner, "curve", look_fails)
    monkeypatch.setenv("AIAYN_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", stack["mlflow"])  # the flow exports it: restored after the test
    # this process stands for the pool's: its sweep file, data root and tracking server (trust model)
    monkeypatch.setenv("AIAYN_CONFIG_DIRS", str(tmp_path))
    monkeypatch.setenv("AIAYN_DATA_ROOT", str(shared_data))
    with temporary_settings({PREFECT_API_URL: prefect.api}), \
            pytest.raises(RuntimeError, match="the controller fails after its trials started"):
        module.sweep_translation(str(_two_trials(tmp_path, failed, idle)), str(shared_data),
                                 tracking_uri=stack["mlflow"], confirm=False)
    (parent,) = mlflow.search_runs([mlflow.get_experiment_by_name(failed).experiment_id], f"tags.sweep = '{failed}'")
    run_id = parent.data.tags["prefect.flow_run_id"]
    assert prefect.flow_run(run_id)["state"]["type"] == "FAILED"
    ended(failed, run_id, "FAILED")


@pytest.mark.slow
@pytest.mark.integration
def test_a_missing_deployment_and_a_count_below_one_are_refused_saying_what_to_do(stack, tmp_path):
    """A sweep whose trial deployment does not exist says which name it looked up and how to create it (Prefect says
    only "ObjectNotFound: None"); ``-p trials=0`` is refused by the server when the run is created (it was taken as
    "not given" and the file's 16 trials ran), so no sweep run exists."""
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.sweep import DeploymentRunner
    from tests.conftest import REPO_ROOT

    prefect = stack["prefect"]
    with temporary_settings({PREFECT_API_URL: prefect.api}), pytest.raises(ConfigError) as e:
        DeploymentRunner("train-en-de/nope", {}, tmp_path, [], "configs/sweeps/x.yaml").check([])
    assert str(e.value) == (
        f"configs/sweeps/x.yaml: deployment 'train-en-de/nope' does not exist on the Prefect server {prefect.api}/: "
        "apply the project's deployments (`.venv/bin/python -m ops.localstack up`, or `prefect --no-prompt deploy "
        "--all` in the project folder), or name an existing one as <flow name>/<deployment name> (`prefect deployment "
        "ls` lists them)")
    before = prefect_runs_tagged(prefect, "sweep-zero")
    for name in ("trials", "max_in_flight"):
        res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "deployment", "run",
                              "sweep-translation/multi30k-cpu", "--params", json.dumps({name: 0}),
                              "--tag", "sweep-zero"], cwd=REPO_ROOT, env=prefect.env, capture_output=True, text=True,
                             timeout=120)
        out = " ".join((res.stdout + res.stderr).split())  # as one line: the console wraps long ones
        assert res.returncode != 0 and f"'{name}'. Failure reason: 0 is less than the minimum of 1" in out, out[-3000:]
    assert prefect_runs_tagged(prefect, "sweep-zero") == before == []


def _api_runs(prefect, parent_id: str) -> list[dict]:
    """The flow runs started by the sweep's flow run ``parent_id`` (its subflows)."""
    from tests.conftest import api

    tasks = api(prefect.api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [parent_id]}}})
    ids = [t["id"] for t in tasks]
    return api(prefect.api, "/flow_runs/filter", {"flow_runs": {"parent_task_run_id": {"any_": ids}}}) if ids else []


def prefect_runs_tagged(prefect, tag: str) -> list[dict]:
    from tests.conftest import api

    return api(prefect.api, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [tag]}}})
