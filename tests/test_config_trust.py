"""The trust model's rules (pipeline.config.trust) and the one reader of config files: what a flow run's parameters
may choose, what only the pool's environment decides, which node runs may train, and errors that name a file
without showing what it holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import CONFIG_DIR, ConfigError, FlowRunTrust, load_config, load_resolved, resolve_config
from pipeline.sweep.config import load_sweep

SECRET = "SECRET-TOKEN-7f3a9c"
KUBECONFIG = f"""apiVersion: v1
kind: Config
clusters:
- cluster: {{server: "https://10.0.0.1:6443"}}
  name: prod
users:
- name: admin
  user: {{token: {SECRET}}}
"""
TRANSLATE = {"task": "translation"}


@pytest.fixture
def pool_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No trust-model variable of this machine's: each test sets the pool's environment it stands for."""
    for name in ("AIAYN_DATA_ROOT", "AIAYN_WORK_DIR", "AIAYN_CONFIG_DIRS", "AIAYN_RUNS_MAY_SET", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _config(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def _cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    status = main(list(args))
    return status, capsys.readouterr().err


# ------------------------------------------------------------------------------------ where configs come from


def test_a_flow_run_names_configs_only_under_configs_and_the_allowed_folders(tmp_path: Path) -> None:
    """By name or by a path inside configs/ or AIAYN_CONFIG_DIRS; anything else, a relative path climbing out and a
    link pointing out included, is refused with one line, the same whether or not a file is there; the files a
    config extends (and its local_data) under the same rule. The CLI still takes any path."""
    outside = _config(tmp_path / "outside", "pair.yaml", "extends: multi30k-cpu\nname: pair\n")
    trust = FlowRunTrust.from_environ({})
    assert trust.resolve("multi30k-cpu").name == "multi30k-cpu"
    assert trust.resolve(str(CONFIG_DIR / "wmt14-en-de-base.yaml")).name == "wmt14-en-de-base"
    refusals = []
    for name in (str(outside), str(tmp_path / "outside" / "missing.yaml"), "../../../../etc/hosts.yaml",
                 "presets/../../tests/fixtures/x"):
        with pytest.raises(ConfigError) as refused:
            trust.resolve(name)
        refusals.append(str(refused.value).replace(repr(name), "<name>"))
    assert len(set(refusals)) == 1, refusals  # no word about whether a file is there
    assert refusals[0].startswith(f"config <name> is not a file under {CONFIG_DIR}: a flow run names a config by "
                                  "name (") and "AIAYN_CONFIG_DIRS" in refusals[0] and "\n" not in refusals[0]
    assert load_config(outside).name == "pair"  # the CLI's owner names any file

    allowed = tmp_path / "team-configs"
    trust = FlowRunTrust.from_environ({"AIAYN_CONFIG_DIRS": str(allowed)})
    assert trust.resolve(str(_config(allowed, "pair.yaml", "extends: multi30k-cpu\nname: team\n"))).name == "team"
    (allowed / "link.yaml").symlink_to(outside)
    for text, what in ((f"extends: {outside}\nname: x\n", "extends"), ("extends: ../outside/pair\nname: x\n",
                                                                       "extends"),
                       (f"extends: multi30k-cpu-hub\nname: x\nlocal_data: {outside}\n", "local_data")):
        path = _config(allowed, "bad.yaml", text)
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {what}: config .* is not a file under "):
            FlowRunTrust.from_environ({"AIAYN_CONFIG_DIRS": str(allowed), "AIAYN_DATA_ROOT": str(tmp_path)}
                                      ).resolve(str(path))
    with pytest.raises(ConfigError, match="is not a file under"):
        trust.resolve(str(allowed / "link.yaml"))  # a link inside that leads outside
    with pytest.raises(ConfigError, match=r"^AIAYN_CONFIG_DIRS: 'team-configs' is a relative path"):
        FlowRunTrust.from_environ({"AIAYN_CONFIG_DIRS": "team-configs"})


def test_the_flows_and_the_sweep_refuse_a_config_or_sweep_file_from_elsewhere(tmp_path: Path, pool_env) -> None:
    """Through the flows' own resolution (flows.common.flow_config, the sweep's load) and the sweep flow's body,
    which stops before anything starts."""
    import flows.sweep as sweep_flow
    from flows.common import flow_config

    path = _config(tmp_path, "k.yaml", KUBECONFIG)
    with pytest.raises(ConfigError, match="is not a file under") as refused:
        flow_config(str(path), {}, None, "train-translation", TRANSLATE)
    assert SECRET not in str(refused.value)
    with pytest.raises(ConfigError, match=r"^sweep '.*k\.yaml' is not a file under .*: a flow run names a sweep by "
                                          r"name \(multi30k-cpu, ptb-sample-cpu\)"):
        load_sweep(str(path), allowed=FlowRunTrust.from_environ({}).config_dirs)
    pool_env.setattr(sweep_flow, "get_run_logger", lambda: None)
    with pytest.raises(ConfigError, match="is not a file under"):
        sweep_flow._run_sweep(str(path), None, None, None, None, True, "translation")
    # a sweep inside the allowed folders whose base config is not
    sweep = _config(tmp_path / "sweeps", "s.yaml", (CONFIG_DIR / "sweeps" / "multi30k-cpu.yaml").read_text(
        encoding="utf-8").replace("base: multi30k-cpu-hub", f"base: {path}"))
    pool_env.setenv("AIAYN_CONFIG_DIRS", str(tmp_path / "sweeps"))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(sweep))}: base .* is not a file under"):
        sweep_flow._run_sweep(str(sweep), None, None, None, None, True, "translation")


# ------------------------------------------------------------------------------ errors that show no values


def test_a_file_that_is_not_a_config_is_named_with_its_keys_never_its_values(tmp_path: Path, capsys,
                                                                              pool_env) -> None:
    """A kubeconfig given as a config (CLI, the flows with its folder allowed) or as a sweep: one line naming the
    file and its keys; a config-shaped file's bad values, unknown fields and YAML errors: the key path or the line,
    never the value. An override's value (the caller's own) is still shown."""
    from flows.common import flow_config

    kube = _config(tmp_path, "kubeconfig.yaml", KUBECONFIG)
    status, err = _cli(capsys, "config", "--config", str(kube))
    assert status == 2 and SECRET not in err and err.count("\n") == 1
    assert err.startswith(f"error: {kube}: not a run config: its top level has 'apiVersion', 'kind', 'clusters', "
                          "'users', which no config has; a config holds name, task,")
    pool_env.setenv("AIAYN_CONFIG_DIRS", str(tmp_path))
    with pytest.raises(ConfigError, match="not a run config") as refused:
        flow_config(str(kube), {}, None, "train-translation", TRANSLATE)
    assert SECRET not in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        load_sweep(str(kube))
    assert SECRET not in str(refused.value) and "apiVersion: Extra inputs are not permitted" in str(refused.value)

    shaped = _config(tmp_path, "shaped.yaml", f"extends: multi30k-cpu\nname: x\ntrain: {{max_steps: {SECRET}, "
                                              f"token: {SECRET}}}\ndecode: {{beam_size: [{SECRET}]}}\n")
    status, err = _cli(capsys, "config", "--config", str(shaped))
    assert status == 2 and SECRET not in err
    for field in ("train.max_steps: Input should be a valid integer", "train.token: Extra inputs are not permitted",
                  "decode.beam_size: Input should be a valid integer"):
        assert f"{shaped}: {field}" in err, err
    broken = _config(tmp_path, "broken.yaml", f"name: x\ntoken: abc: {SECRET}\n")
    status, err = _cli(capsys, "config", "--config", str(broken))
    assert (status, err) == (2, f"error: {broken}: not valid YAML: line 2, column 11: mapping values are not "
                                "allowed here\n")
    status, err = _cli(capsys, "config", "--set", "train.max_steps=abc")
    assert "--set train.max_steps=abc: train.max_steps: Input should be a valid integer (got 'abc')" in err


def test_a_config_file_that_is_not_utf8_text_is_one_line_naming_the_line_and_byte(tmp_path: Path, capsys) -> None:
    """A Latin-1 byte, a NUL, an unreadable path: one line, exit status 2, no traceback (before: a
    UnicodeDecodeError's); a resolved config file is read by the same reader."""
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("extends: multi30k-cpu\nname: caf\xe9\n".encode("latin-1"))
    status, err = _cli(capsys, "config", "--config", str(latin))
    assert (status, err) == (2, f"error: {latin}: line 2 (byte offset 31) is not UTF-8 text (invalid continuation "
                                "byte); save the file as UTF-8 (iconv -f <encoding> -t UTF-8)\n")
    with pytest.raises(ConfigError, match=r"line 2 \(byte offset 31\) is not UTF-8"):
        load_resolved(latin)
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"extends: multi30k-cpu\nname: a\x00b\n")
    status, err = _cli(capsys, "config", "--config", str(nul))
    assert (status, err) == (2, f"error: {nul}: not valid YAML: line 2: character #x0000 is not allowed in YAML "
                                "(special characters are not allowed)\n")
    folder = tmp_path / "a-folder.yaml"
    folder.mkdir()
    status, err = _cli(capsys, "config", "--config", str(folder / "x.yaml"))
    assert status == 2 and "not found" in err


# --------------------------------------------------------------------------------- what the pool decides


def test_data_root_work_dir_and_tracking_uri_are_the_pools_unless_the_deployment_opts_in(tmp_path: Path) -> None:
    """A run's data_root, data.root, work_dir (however nested) and tracking_uri that name another place than the
    pool's environment are refused, one line naming the parameter and what to do; the same value as the
    environment's is no change; AIAYN_RUNS_MAY_SET lets the deployment allow each; a malformed opt-in is refused."""
    work, data = tmp_path / "work", tmp_path / "data"
    pool = {"AIAYN_WORK_DIR": str(work), "AIAYN_DATA_ROOT": str(data), "MLFLOW_TRACKING_URI": "http://mlflow:5000"}
    trust = FlowRunTrust.from_environ(pool)
    cases = [({"work_dir": "/elsewhere"}, None, "override work_dir='/elsewhere': work_dir"),
             ({"data.root": "/"}, None, "override data.root='/': data_root"),
             ({"data": {"root": "/"}}, None, "override data.root='/': data_root"),
             ({}, "/", "parameter data_root='/': data_root")]
    for overrides, data_root, label in cases:
        with pytest.raises(ConfigError) as refused:
            trust.resolve("multi30k-cpu", overrides, data_root)
        name = label.rsplit(": ", 1)[1]
        assert str(refused.value) == (f"{label} is not a flow run's to choose: the environment's "
                                      f"{'AIAYN_WORK_DIR' if name == 'work_dir' else 'AIAYN_DATA_ROOT'} decides "
                                      f"it; leave it out, or have the deployment allow it (AIAYN_RUNS_MAY_SET="
                                      f"{name} in its work pool's environment)")
    same = trust.resolve("multi30k-cpu", {"work_dir": str(work / "." )}, str(data))
    assert (Path(same.work_dir), Path(same.data.root)) == (work, data)
    with pytest.raises(ConfigError, match=r"^parameter tracking_uri: tracking_uri is not a flow run's to choose") \
            as refused:
        trust.tracking_uri("http://user:pw@evil:5000", work)
    assert "pw@evil" not in str(refused.value)
    assert trust.tracking_uri(None, work) == trust.tracking_uri("http://mlflow:5000", work) == "http://mlflow:5000"
    # nothing in the environment: the deployment's config decides, and SQLite in the work dir is the server
    bare = FlowRunTrust.from_environ({})
    with pytest.raises(ConfigError, match=r"work_dir is not a flow run's to choose: the deployment \(its config, "
                                          r"or AIAYN_WORK_DIR, unset here\) decides it"):
        bare.resolve("multi30k-cpu", {"work_dir": str(work)})
    assert bare.tracking_uri(f"sqlite:///{work}/mlflow.db", work) == f"sqlite:///{work}/mlflow.db"
    with pytest.raises(ConfigError, match="parameter tracking_uri"):
        bare.tracking_uri("http://elsewhere", work)
    opted = FlowRunTrust.from_environ({**pool, "AIAYN_RUNS_MAY_SET": "work_dir, data_root,tracking_uri"})
    cfg = opted.resolve("multi30k-cpu", {"work_dir": "/elsewhere"}, "/")
    assert (cfg.work_dir, cfg.data.root) == ("/elsewhere", "/")
    assert opted.tracking_uri("http://elsewhere", work) == "http://elsewhere"
    with pytest.raises(ConfigError, match=r"^AIAYN_RUNS_MAY_SET: \['everything'\] are not settings"):
        FlowRunTrust.from_environ({"AIAYN_RUNS_MAY_SET": "everything"})
    assert resolve_config("multi30k-cpu", {"work_dir": "/elsewhere"}, environ=pool).work_dir == "/elsewhere"  # CLI


def test_the_pipeline_flows_resolve_their_parameters_under_the_rules(tmp_path: Path, pool_env) -> None:
    """flows.common.flow_config (every pipeline flow's resolution, and distill's teacher_configs) refuses what the
    pool decides, tracking_uri included, before anything starts."""
    from flows.common import flow_config

    pool_env.setenv("AIAYN_WORK_DIR", str(tmp_path / "work"))
    pool_env.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    with pytest.raises(ConfigError, match=r"^override work_dir='/tmp/other': work_dir is not a flow run's"):
        flow_config("multi30k-cpu", {"work_dir": "/tmp/other"}, None, "train-en-de", {})
    with pytest.raises(ConfigError, match=r"^parameter tracking_uri: "):
        flow_config("multi30k-cpu", {}, None, "train-en-de", {}, "http://other:5000")
    assert flow_config("multi30k-cpu", {}, None, "train-en-de", {}, "http://mlflow:5000").work_dir == \
        str(tmp_path / "work")
    assert not (tmp_path / "work").exists()  # refused or resolved: nothing written yet


def test_a_runs_teacher_files_lie_in_its_work_dir_or_data_root(tmp_path: Path) -> None:
    """distill.teachers checkpoint files and distill.translations a flow run names (the distill flow's teachers
    join them) must lie under the run's work dir or data root; registered versions are names, not files."""
    work, data = tmp_path / "work", tmp_path / "data"
    trust = FlowRunTrust.from_environ({"AIAYN_WORK_DIR": str(work), "AIAYN_DATA_ROOT": str(data)})
    ok = [str(work / "runs" / "x" / "averaged" / "last3.pt"), "models:/transformer-en-de@champion"]
    assert trust.resolve("multi30k-student-tiny", {"distill.teachers": ok}).distill.teachers == ok
    assert trust.resolve("multi30k-cpu", {"distill.translations": str(data / "t")}).distill.translations
    for field, value, name in (("distill.teachers", [ok[1], "/srv/other-team/model.pt"], "/srv/other-team/model.pt"),
                               ("distill.translations", "../../elsewhere", "../../elsewhere")):
        with pytest.raises(ConfigError, match=rf"^override {re.escape(field)}: {re.escape(repr(name))} lies outside "
                                              rf"the run's work dir \({re.escape(str(work))}\) and data root"):
            trust.resolve("multi30k-cpu", {field: value})


# ------------------------------------------------------------------------------------------- node runs


def test_a_node_run_trains_only_as_the_run_its_training_stage_recorded(tmp_path: Path) -> None:
    """The stage records each node run it creates under the pool's work dir; a node claims its record once, with
    exactly the parameters recorded; a run by hand (no record), with other parameters, or started again is
    refused, one line each."""
    trust = FlowRunTrust.from_environ({"AIAYN_WORK_DIR": str(tmp_path / "work")})
    params = {"config_file": "/w/run/config.yaml", "shards": "/w/shards/x", "out": "/w/run", "node_rank": 1,
              "launch": {"nnodes": 2, "rdzv_timeout_s": 60.0}, "rdzv_endpoint": "127.0.0.1:29500", "rdzv_id": "a-1",
              "extra": ["--launcher-holds-lock"], "init_checkpoint": None}
    record = trust.record_node_run("run-1", "parent-1", params)
    assert record.parent == tmp_path / "work" / "node-runs"
    with pytest.raises(ConfigError, match=r"^flow run run-1: parameters \['extra', 'out'\] differ from those its "
                                          r"training stage \(flow run parent-1\) recorded: train-node runs only"):
        trust.claim_node_run("run-1", {**params, "out": "/other/run", "extra": ["--mlflow-run-id", "x"]})
    trust.record_node_run("run-1", "parent-1", params)
    assert trust.claim_node_run("run-1", params) == "parent-1"
    with pytest.raises(ConfigError, match=r"^flow run run-1 is not a node any training stage recorded .*taken "
                                          r"already\): train-node runs only as a node of a pipeline flow run's"):
        trust.claim_node_run("run-1", params, wait_s=0)  # the same run again
    with pytest.raises(ConfigError, match="is not a node any training stage recorded"):
        trust.claim_node_run("by-hand", params, wait_s=0)
    with pytest.raises(ConfigError, match="^not a flow run: train-node runs only"):
        trust.claim_node_run(None, params)
    trust.record_node_run("never-started", "parent-1", params)
    trust.forget_node_run("never-started")
    assert not list(record.parent.iterdir())


def test_the_node_flow_refuses_to_train_outside_a_flow_run() -> None:
    """flows/nodes.py checks before its torchrun agent starts."""
    from flows.nodes import train_node

    with pytest.raises(ConfigError, match="^not a flow run: train-node runs only"):
        train_node.fn("/etc/config.yaml", "/tmp/shards", "/tmp/out", {"nnodes": 2}, 1, "127.0.0.1:1", "x", [])


# -------------------------------------------------------------------------------------- refused at load


def test_names_that_mlflow_and_prefect_show_refuse_control_and_bidi_characters(tmp_path: Path) -> None:
    """A right-to-left override, a newline or a zero-width space in the config's name, preset, experiment or
    registered model: refused naming the field and the character (not the name, when a file gave it)."""
    for field in ("name", "preset", "tracking.experiment", "tracking.registered_model"):
        for ch in ("\u202e", "\n", "\u200b"):
            with pytest.raises(ConfigError, match=rf"{re.escape(field)}: Value error, character 4 is "
                                                  rf"U\+{ord(ch):04X} .* write the name in printable characters"):
                load_config("multi30k-cpu", {field: f"abc{ch}def"})
    path = _config(tmp_path, "rtl.yaml", 'extends: multi30k-cpu\nname: "run\u202egpj.exe"\n')
    with pytest.raises(ConfigError, match=r": name: Value error, character 4 is U\+202E \(RIGHT-TO-LEFT OVERRIDE\)")\
            as refused:
        load_config(path)
    assert "gpj" not in str(refused.value)
    assert load_config("multi30k-cpu", {"name": "Übersetzung-日本"}).name == "Übersetzung-日本"


def test_a_min_len_no_output_can_reach_is_refused_at_load() -> None:
    """decode.min_len past the shortest source's length limit (max_len_a * 1 + max_len_b) or past the model's
    positions, for the run's decoding and the teachers': refused naming the fields (before: an IndexError after the
    whole decode)."""
    with pytest.raises(ConfigError, match=r"decode: Value error, min_len \(60\) exceeds the length limit of the "
                                          r"shortest source, max_len_a \* 1 \+ max_len_b = 51: .*raise max_len_b"):
        load_config("multi30k-cpu", {"decode.min_len": 60})
    with pytest.raises(ConfigError, match=r"distill\.decode: Value error, min_len \(4\) exceeds .* = 3"):
        load_config("multi30k-cpu", {"distill.decode.min_len": 4, "distill.decode.max_len_a": 0.0,
                                     "distill.decode.max_len_b": 3})
    with pytest.raises(ConfigError, match=r"decode\.min_len \(2000\) exceeds the longest output the model has "
                                          r"positions for, model\.max_positions - 1 = 1023"):
        load_config("multi30k-cpu", {"decode.min_len": 2000, "decode.max_len_b": 3000})
    assert load_config("multi30k-cpu", {"decode.min_len": 50, "decode.max_len_a": 0.0}).decode.min_len == 50


def test_a_run_that_cannot_leave_the_checkpoints_it_averages_is_refused_before_training(tmp_path: Path, capsys,
                                                                                       pool_env) -> None:
    """max_steps over checkpoint_every_steps (one at the end too), or keep_last_checkpoints, short of average.last_n
    (or the smallest of choose_from): the flows and the run command refuse it naming both fields, before any stage
    (before: it trained to the end, then averaging failed); the train command still trains it."""
    from flows.common import flow_config

    with pytest.raises(ConfigError, match=r"^config 'ptb-sample-cpu': average\.last_n needs 3 checkpoints, but "
                                          r"train\.max_steps=10 writes 1 \(one every train\.checkpoint_every_steps="
                                          r"100 and one at the end\): set train\.checkpoint_every_steps to 3 or less"):
        flow_config("ptb-sample-cpu", {"train.max_steps": 10}, None, "parse-wsj", {"task": "parsing"})
    with pytest.raises(ConfigError, match=r"average\.choose_from needs 4 checkpoints, but train\.keep_last_"
                                          r"checkpoints keeps 3: raise it to 4 or more"):
        flow_config("multi30k-cpu", {"average.choose_from": [4, 8], "train.keep_last_checkpoints": 3}, None,
                    "train-en-de", {})
    assert flow_config("ptb-sample-cpu", {"train.max_steps": 10, "train.checkpoint_every_steps": 3}, None,
                       "parse-wsj", {"task": "parsing"}).train.max_steps == 10  # steps 3, 6, 9 and 10
    work = tmp_path / "work"
    status, err = _cli(capsys, "run", "--config", "ptb-sample-cpu", "--set", "train.max_steps=10", "--work-dir",
                       str(work))
    assert status == 2 and "average.last_n needs 3 checkpoints, but train.max_steps=10 writes 1" in err
    assert list(work.iterdir()) == []  # no stage ran


def test_the_train_and_run_commands_refuse_more_processes_than_their_one(tmp_path: Path, capsys) -> None:
    """launch.nproc_per_node=2 or launch.nnodes=2 through the CLI, which trains in its own one process: refused
    before any stage, saying how to get several (before: accepted, then trained in one without a word)."""
    work = tmp_path / "work"
    for command, setting in (("train", "launch.nproc_per_node=2"), ("run", "launch.nnodes=2")):
        status, err = _cli(capsys, command, "--set", setting, "--work-dir", str(work))
        assert (status, err) == (2, f"error: {setting}: the {command} command trains in this one process; for "
                                    "several, run the pipeline's flow, or torchrun by hand (docs/tutorials/multi-node"
                                    ".md#torchrun-by-hand), or set launch.nproc_per_node=1 and launch.nnodes=1\n")
    assert list(work.iterdir()) == []
    status, _ = _cli(capsys, "config", "--set", "launch.nproc_per_node=2")  # a config for torchrun is fine
    assert status == 0


# ------------------------------------------------------------------------- through a real deployment run


@pytest.mark.integration
def test_a_deployment_run_cannot_read_a_file_elsewhere_nor_start_a_node_by_hand(stack, tmp_path: Path) -> None:
    """On the real stack: a run naming a kubeconfig outside the allowed folders, and one naming it inside them, fail
    with a state message that names the file and shows none of its values; a train-node run started by hand fails
    without training; a run named with a right-to-left override fails before its name reaches MLflow."""
    prefect = stack["prefect"]
    outside = _config(Path("/tmp") / f"aiayn-trust-{tmp_path.name}", "kubeconfig.yaml", KUBECONFIG)
    inside = _config(tmp_path, "kubeconfig.yaml", KUBECONFIG)  # the stack allows the tests' folders
    for path, words in ((outside, "is not a file under"), (inside, "not a run config")):
        status, out, run = prefect.run_deployment("train-translation/any-pair", {"config": str(path)}, timeout=300)
        state = prefect.flow_run(run)["state"]
        assert status != 0 and state["type"] == "FAILED", out[-2000:]
        assert words in state["message"] and SECRET not in state["message"] + prefect.logs(run) + out
    params = {"config_file": str(tmp_path / "config.yaml"), "shards": str(tmp_path), "out": str(tmp_path),
              "launch": {"nnodes": 2}, "node_rank": 1, "rdzv_endpoint": "127.0.0.1:29599", "rdzv_id": "by-hand",
              "extra": []}
    status, out, run = prefect.run_deployment("train-node/local", params, timeout=300)
    state = prefect.flow_run(run)["state"]
    assert status != 0 and state["type"] == "FAILED"
    assert f"flow run {run} is not a node any training stage recorded" in state["message"]
    assert "torch.distributed.run" not in prefect.logs(run)
    status, out, run = prefect.run_deployment("train-en-de/multi30k-cpu", {"max_steps": 1}, timeout=300,
                                           run_name="run\u202egpj")
    state = prefect.flow_run(run)["state"]
    assert status != 0 and state["type"] == "FAILED", out[-2000:]
    assert state["message"].endswith("flow run name 'run\\u202egpj': character 4 is U+202E (RIGHT-TO-LEFT OVERRIDE), "
                                     "which is not shown as itself (a right-to-left override shows a name reversed in "
                                     "MLflow and Prefect); start the run with a name in printable characters "
                                     "(prefect deployment run ... --flow-run-name NAME)"), state["message"]
