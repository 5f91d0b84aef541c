"""A real full disk: the stage runs in a child process inside a private mount namespace whose work folder is a
small tmpfs, so its writes meet the kernel's ENOSPC (no injected errno). Each test asserts the one line a user
reads (the file, what the write needs, what is free), the exit status, no traceback, and that a rerun once
there is room completes with exactly the output of a run that never met the full disk."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.train_helpers import assert_same_tensors, final_state, torchrun_env, train_command

PYTHON = shlex.quote(sys.executable)


def on_small_disk(folder: Path, size: str, script: str) -> None:
    """Run the bash ``script`` in a private mount namespace in which ``folder`` is a fresh tmpfs of ``size``; skip
    where the kernel or the user may not (not root, no user namespaces). The tmpfs goes with the namespace, so
    the script copies out what the test reads; it runs on with a command that fails (the test reads each one's
    status from the file the script writes)."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "-o",
                            "size=1m", "tmpfs", str(folder)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace with a tmpfs here (unshare --mount; mount -t tmpfs): "
                    f"{probe.stderr.strip()}")
    mount = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(folder))}\n"
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-uc", mount + script],
                          cwd=REPO_ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def run_step(name: str, command: str, logs: Path) -> str:
    """A line of an :func:`on_small_disk` script: ``command``, its stderr into ``logs/<name>.err`` and its exit
    status into ``logs/<name>.rc``."""
    err, rc = shlex.quote(str(logs / f"{name}.err")), shlex.quote(str(logs / f"{name}.rc"))
    return f"{command} >/dev/null 2>{err}; echo $? >{rc}\n"


def fill_leaving(folder: Path, free: str) -> str:
    """Lines of an :func:`on_small_disk` script that fill ``folder`` with a file ``filler`` until ``free`` bytes
    (a shell arithmetic expression) are left."""
    q = shlex.quote(str(folder))
    return f"avail=$(df -B1 --output=avail {q} | tail -1)\nhead -c $((avail - ({free}))) /dev/zero >{q}/filler\n"


def outcome(logs: Path, name: str) -> tuple[int, str]:
    return int((logs / f"{name}.rc").read_text()), (logs / f"{name}.err").read_text()


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.integration
def test_a_full_disk_in_the_shard_stage_names_the_shard_and_the_space_it_needs(shared_data, tmp_path) -> None:
    """``tokenize`` on a 3 MiB work dir: the corpus and the tokenizer fit, the training split's shard does not.
    One line names the shard, at least what it needs (what it held plus the batch being written) and what is
    free, exit status 2; the same command on the same folder grown to 64 MiB resumes the shards already written
    and gives byte for byte the shard folder of a run on a disk with room."""
    args = ("-m pipeline tokenize --config multi30k-cpu --set tokenizer.vocab_size=1000 "
            f"--data-root {shlex.quote(str(shared_data))} --work-dir")
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, *shlex.split(args), str(reference)], cwd=REPO_ROOT, env=torchrun_env(),
                   check=True, capture_output=True)
    work, logs, copy = tmp_path / "small", tmp_path / "logs", tmp_path / "copy"
    logs.mkdir()
    q = shlex.quote
    on_small_disk(work, "3m", run_step("full", f"{PYTHON} {args} {q(str(work))}", logs)
                  + f"mount -o remount,size=64m {q(str(work))}\n"
                  + run_step("room", f"{PYTHON} {args} {q(str(work))}", logs)
                  + f"cp -r {q(str(work / 'shards'))} {q(str(copy))}\n")
    status, stderr = outcome(logs, "full")
    line = one_error_line(stderr)
    assert status == 2, stderr[-3000:]
    assert line.startswith(f"error: {work}/shards/."), line  # the partial folder, kept for the resume
    assert "/train-00000.arrow: no space left on device: this write needs at least " in line, line
    assert f"MiB free on {work}" in line and "point work_dir (--work-dir, AIAYN_WORK_DIR) at a larger disk" in line
    status, stderr = outcome(logs, "room")
    assert status == 0, stderr[-3000:]
    (expected,) = [p for p in (reference / "shards").iterdir() if p.is_dir()]
    assert files(copy / expected.name) == files(expected)


@pytest.mark.integration
def test_a_full_disk_in_the_tokenizer_stage_names_the_model_file_and_a_rerun_gives_the_same_tokenizer(
        shared_data, tmp_path) -> None:
    """The corpus written with room, then ``tokenize`` with 16 KiB left: the sentencepiece model and its vocabulary
    do not fit. One line names the file of the tokenizer folder, what it needs and what is free, exit status 2, and
    no tokenizer folder is left that could look finished; with the filler gone the same command gives byte for byte
    the tokenizer of a disk with room."""
    args = ("--config multi30k-cpu --set tokenizer.vocab_size=1000 "
            f"--data-root {shlex.quote(str(shared_data))} --work-dir")
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, "-m", "pipeline", "tokenize", *shlex.split(args), str(reference)], cwd=REPO_ROOT,
                   env=torchrun_env(), check=True, capture_output=True)
    work, logs, copy = tmp_path / "small", tmp_path / "logs", tmp_path / "copy"
    logs.mkdir()
    q = shlex.quote
    on_small_disk(work, "64m", run_step("data", f"{PYTHON} -m pipeline prepare-data {args} {q(str(work))}", logs)
                  + fill_leaving(work, "16 * 1024")
                  + run_step("full", f"{PYTHON} -m pipeline tokenize {args} {q(str(work))}", logs)
                  + f"ls -a {q(str(work / 'tokenizer'))} >{q(str(logs / 'left'))}\n"
                  + f"rm {q(str(work / 'filler'))}\n"
                  + run_step("room", f"{PYTHON} -m pipeline tokenize {args} {q(str(work))}", logs)
                  + f"cp -r {q(str(work / 'tokenizer'))} {q(str(copy))}\n")
    assert outcome(logs, "data")[0] == 0, outcome(logs, "data")[1][-3000:]
    status, stderr = outcome(logs, "full")
    line = one_error_line(stderr)
    assert status == 2, stderr[-3000:]
    # the tokenizer folder writes its files under a temporary name and is named as the folder it becomes
    assert re.match(rf"error: {re.escape(str(work))}/tokenizer/[0-9a-f]+/spm\.(model|vocab): no space left on "
                    r"device: this write needs ", line), line
    assert f"free on {work}" in line and "point work_dir (--work-dir, AIAYN_WORK_DIR) at a larger disk" in line
    assert [n for n in (logs / "left").read_text().split() if not n.startswith(".")] == []  # nothing finished-looking
    assert outcome(logs, "room")[0] == 0, outcome(logs, "room")[1][-3000:]
    (expected,) = [p for p in (reference / "tokenizer").iterdir() if p.is_dir()]
    assert files(copy / expected.name) == files(expected)


@pytest.mark.integration
def test_a_full_disk_at_a_checkpoint_names_its_size_and_a_rerun_resumes_exactly(shared_data, shards,
                                                                                tmp_path) -> None:
    """Training to step 2 on a tmpfs, then a filler file leaving half a checkpoint free: the run to step 4 ends
    with one line naming the checkpoint, about what it needs, what is free and the step-2 checkpoint kept (exit
    status 2, nothing else in the folder); with the filler deleted, the same command resumes and its model
    equals, tensor for tensor, that of a run to step 4 that never met the full disk."""
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, *train_command(shared_data, shards, reference, "train.max_steps=4")],
                   cwd=REPO_ROOT, env=torchrun_env(), check=True, capture_output=True, timeout=300)
    work, logs, copy = tmp_path / "small", tmp_path / "logs", tmp_path / "copy"
    logs.mkdir()
    run = work / "run"
    q = shlex.quote

    def train(steps: int) -> str:
        return " ".join(map(q, [sys.executable, *train_command(shared_data, shards, run, f"train.max_steps={steps}")]))

    ckpt2 = q(str(run / "checkpoints" / "ckpt-00000002.pt"))
    filler = q(str(work / "filler"))
    on_small_disk(work, "64m", run_step("step2", train(2), logs)
                  + f"size=$(stat -c %s {ckpt2})\n" + fill_leaving(work, "size / 2")
                  + run_step("full", train(4), logs)
                  + f"ls -A {q(str(run / 'checkpoints'))} >{q(str(logs / 'left'))}\n"
                  + f"rm {filler}\n"
                  + run_step("room", train(4), logs)
                  + f"cp -r {q(str(run))} {q(str(copy))}\n")
    assert outcome(logs, "step2")[0] == 0, outcome(logs, "step2")[1][-3000:]
    status, stderr = outcome(logs, "full")
    line = one_error_line(stderr)
    assert status == 2, stderr[-3000:]
    assert f"could not write checkpoint {run}/checkpoints/ckpt-00000004.pt: no space left on device: this write " \
           "needs about " in line, line
    assert f"MiB free on {work}; free at least " in line, line
    assert f"the last intact checkpoint, {run}/checkpoints/ckpt-00000002.pt (step 2), is still there" in line, line
    assert (logs / "left").read_text().split() == ["ckpt-00000002.pt", "index.json"]
    status, stderr = outcome(logs, "room")
    assert status == 0, stderr[-3000:]
    assert final_state(copy)["step"] == 4
    assert_same_tensors(final_state(copy)["model"], final_state(reference)["model"])


# The averaging stage alone, as its task calls it: argv is the run folder; a UserError is one line and status 2,
# as the command line prints it.
_AVERAGE = """
import sys
from pathlib import Path
from pipeline.average import average_run
from pipeline.support.errors import UserError
from tests.conftest import tiny_config
try:
    average_run(tiny_config(Path(sys.argv[1]), "average.last_n=2"), Path(sys.argv[2]))
except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.integration
def test_a_full_disk_while_averaging_names_the_average_and_its_size(shared_data, shards, tmp_path) -> None:
    """A run's two checkpoints on a tmpfs with half an averaged checkpoint free: averaging ends with one line
    naming the averaged file and about what it needs (exit status 2, no partial file); on the same folder grown,
    the average equals, tensor for tensor, the one written on a disk with room."""
    from pipeline.checkpoint import load_checkpoint

    reference = tmp_path / "reference"
    subprocess.run([sys.executable, *train_command(shared_data, shards, reference, "train.max_steps=2",
                                                   "train.checkpoint_every_steps=1")],
                   cwd=REPO_ROOT, env=torchrun_env(), check=True, capture_output=True, timeout=300)
    average = [sys.executable, "-c", _AVERAGE, str(shared_data)]
    subprocess.run([*average, str(reference)], cwd=REPO_ROOT, env=torchrun_env(), check=True, capture_output=True)
    work, logs, copy = tmp_path / "small", tmp_path / "logs", tmp_path / "copy"
    logs.mkdir()
    run, q = work / "run", shlex.quote
    command = " ".join(map(q, [*average, str(run)]))
    ckpt = q(str(reference / "checkpoints" / "ckpt-00000002.pt"))
    on_small_disk(work, "64m", f"mkdir {q(str(run))}; cp -r {q(str(reference / 'checkpoints'))} {q(str(run))}/\n"
                  + f"size=$(stat -c %s {ckpt})\n" + fill_leaving(work, "size / 2")
                  + run_step("full", command, logs)
                  + f"ls -A {q(str(run / 'averaged'))} >{q(str(logs / 'left'))}\n"
                  + f"mount -o remount,size=128m {q(str(work))}\n"
                  + run_step("room", command, logs)
                  + f"cp -r {q(str(run / 'averaged'))} {q(str(copy))}\n")
    status, stderr = outcome(logs, "full")
    line = one_error_line(stderr)
    assert status == 2 and line.startswith(f"error: {run}/averaged/last2.pt: no space left on device: this write "
                                           "needs about "), stderr[-3000:]
    assert f"MiB free on {work}; free at least " in line and "point work_dir" in line, line
    assert (logs / "left").read_text().split() == []
    assert outcome(logs, "room")[0] == 0, outcome(logs, "room")[1][-3000:]
    assert_same_tensors(load_checkpoint(copy / "last2.pt")["model"],
                        load_checkpoint(reference / "averaged" / "last2.pt")["model"])


# The export stage alone, as its task calls it: argv is the shared data, the checkpoint (its export is written
# beside it), the tokenizer, the corpus and the evaluation's scores.json.
_EXPORT = """
import sys
from pathlib import Path
from pipeline.config import ExportConfig
from pipeline.export import export_model
from pipeline.support.errors import UserError
from tests.conftest import tiny_config
shared, checkpoint, tokenizer, corpus, scores = map(Path, sys.argv[1:6])
cfg = tiny_config(shared).model_copy(update={"export": ExportConfig(quantization="float32", max_bleu_drop=100)})
try:
    export_model(cfg, checkpoint, tokenizer, corpus, scores)
except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.integration
def test_a_full_disk_while_exporting_names_the_model_file_and_a_rerun_gates_the_same_export(
        shared_data, tiny_stack, tmp_path) -> None:
    """A checkpoint on a tmpfs with half its CTranslate2 model free: the export stage ends with one line naming
    the export's model file, at least what it needs and what is free (exit status 2), and leaves no folder
    beside the checkpoint, so nothing looks like a finished export; with room, the same command writes the
    export and its gate, file for file the export written on a disk with room."""
    from pipeline.engines import GATE
    from pipeline.export import MODEL_FILE
    from pipeline.train import train
    from pipeline.translation.evaluate import evaluate_translation
    from tests.conftest import tiny_config

    cfg = tiny_config(shared_data, "train.max_steps=2")
    run = train(cfg, tiny_stack.shards, tmp_path / "run")
    checkpoint = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
    scores = evaluate_translation(checkpoint, tiny_stack.tokenizer, tiny_stack.corpus, cfg.decode,
                                  tmp_path / "eval", splits=["dev"])
    export = [sys.executable, "-c", _EXPORT, str(shared_data)]
    rest = [str(tiny_stack.tokenizer), str(tiny_stack.corpus), str(scores)]
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(checkpoint, reference / checkpoint.name)
    subprocess.run([*export, str(reference / checkpoint.name), *rest], cwd=REPO_ROOT, env=torchrun_env(),
                   check=True, capture_output=True, timeout=600)
    (expected,) = [p for p in reference.iterdir() if p.is_dir()]
    work, logs, copy = tmp_path / "small", tmp_path / "logs", tmp_path / "copy"
    logs.mkdir()
    q = shlex.quote
    command = " ".join(map(q, [*export, str(work / checkpoint.name), *rest]))
    size = (expected / MODEL_FILE).stat().st_size
    on_small_disk(work, "128m", f"cp {q(str(checkpoint))} {q(str(work))}/\n"
                  + fill_leaving(work, str(size // 2))
                  + run_step("full", command, logs)
                  + f"ls -A {q(str(work))} >{q(str(logs / 'left'))}\n"
                  + f"rm {q(str(work / 'filler'))}\n"
                  + run_step("room", command, logs)
                  + f"cp -r {q(str(work / expected.name))} {q(str(copy))}\n")
    status, stderr = outcome(logs, "full")
    line = one_error_line(stderr)
    out = work / expected.name
    assert status == 2 and line.startswith(f"error: {out}/{MODEL_FILE}: no space left on device: this write "
                                           "needs at least "), stderr[-3000:]
    assert f"MiB free on {work}" in line and "point work_dir" in line, line
    assert sorted((logs / "left").read_text().split()) == sorted(["filler", checkpoint.name])
    assert outcome(logs, "room")[0] == 0, outcome(logs, "room")[1][-3000:]
    # gate.json holds the gate's decoding speed besides its verdict
    assert {k: v for k, v in files(copy).items() if k != GATE} == \
        {k: v for k, v in files(expected).items() if k != GATE}
    assert json.loads((copy / GATE).read_text())["export_bleu"] == \
        json.loads((expected / GATE).read_text())["export_bleu"]


# The decoding stages that write a corpus, alone: argv is the stage (distill: the toy corpus's translations;
# silver: a parsing corpus's silver trees), the resolved config, the work dir (the corpus is written under it),
# the corpus, the teacher, the tokenizer and, for silver, the unlabelled sentences.
_DECODE_CORPUS = """
import sys
from pathlib import Path
from pipeline.config import load_resolved
from pipeline.distill import distill_corpus
from pipeline.silver import silver_corpus
from pipeline.support.errors import UserError
stage, config, work, corpus, teacher, tokenizer, *unlabelled = sys.argv[1:]
distill = load_resolved(Path(config)).distill
try:
    if stage == "distill":
        distill_corpus(Path(corpus), [Path(teacher)], Path(tokenizer), distill, Path(work))
    else:
        silver_corpus(Path(corpus), [Path(teacher)], Path(tokenizer), distill, Path(unlabelled[0]), Path(work))
except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.integration
@pytest.mark.parametrize("stage", ["distill", "silver"])
def test_a_full_disk_while_decoding_a_corpus_names_the_chunk_and_a_rerun_gives_the_same_corpus(
        stage, shared_data, tmp_path) -> None:
    """Distilling the toy corpus (distill), or parsing unlabelled news into silver trees (silver), on a full
    tmpfs: one line naming the chunk of decoded sentences being written and what is free (exit status 2, no
    traceback); with room, the same command gives byte for byte the corpus of a run on a disk with room."""
    from pipeline.config import write_resolved
    from pipeline.support.fsutil import MANIFEST
    from tests.test_distill import CHUNK, Toy, toy_config
    from tests.test_silver import Semi

    if stage == "distill":
        toy = Toy(tmp_path / "toy")
        cfg = toy_config(toy.root, toy.work, f"distill.chunk_sentences={CHUNK}")
        inputs = [str(toy.corpus), str(toy.teachers[0]), str(toy.tokenizer_dir)]
    else:
        semi = Semi(shared_data, tmp_path / "semi")
        cfg = semi.cfg
        inputs = [str(semi.corpus), str(semi.teacher), str(semi.tokenizer_dir), str(semi.unlabelled())]
    config = write_resolved(cfg, tmp_path / "config.yaml")
    decode = [sys.executable, "-c", _DECODE_CORPUS, stage, str(config)]
    reference = tmp_path / "reference"
    subprocess.run([*decode, str(reference), *inputs], cwd=REPO_ROOT, env=torchrun_env(), check=True,
                   capture_output=True, timeout=600)
    (expected,) = [p for p in (reference / "distilled").iterdir() if p.is_dir()]
    work, logs, copy = tmp_path / "small", tmp_path / "logs", tmp_path / "copy"
    logs.mkdir()
    q = shlex.quote
    command = " ".join(map(q, [*decode, str(work), *inputs]))
    on_small_disk(work, "1m", f"cat /dev/zero >{q(str(work / 'filler'))} 2>/dev/null\n"
                  + run_step("full", command, logs)
                  + f"rm {q(str(work / 'filler'))}\n"
                  + run_step("room", command, logs)
                  + f"cp -r {q(str(work / 'distilled'))} {q(str(copy))}\n")
    status, stderr = outcome(logs, "full")
    line = one_error_line(stderr)
    assert status == 2 and line.startswith(f"error: {work}/distilled/."), stderr[-3000:]
    assert "/chunk-000000.parquet: no space left on device: this write needs at least " in line, line
    assert f"MiB free on {work}" in line and "point work_dir" in line, line
    assert outcome(logs, "room")[0] == 0, outcome(logs, "room")[1][-3000:]
    for name in ("train.parquet", MANIFEST):
        assert (copy / expected.name / name).read_bytes() == (expected / name).read_bytes()
