"""A real full disk: the stage runs in a child process inside a private mount namespace whose work folder is a
small tmpfs, so its writes meet the kernel's ENOSPC (no injected errno). Each test asserts the one line a user
reads (the file, what the write needs, what is free), the exit status, no traceback, and that a rerun once
there is room completes with exactly the output of a run that never met the full disk."""

from __future__ import annotations

import shlex
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
                  + f"size=$(stat -c %s {ckpt2}); avail=$(df -B1 --output=avail {q(str(work))} | tail -1)\n"
                  + f"head -c $((avail - size / 2)) /dev/zero >{filler}\n"
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
                  + f"size=$(stat -c %s {ckpt}); avail=$(df -B1 --output=avail {q(str(work))} | tail -1)\n"
                  + f"head -c $((avail - size / 2)) /dev/zero >{q(str(work / 'filler'))}\n"
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
