"""Where a measurement or a run came from: the commit of the checkout it ran at.

Plain git, no tracking server: the tracking package tags runs with it, the benchmarks and studies write it into
their records.
"""

from __future__ import annotations

import os
import subprocess

from pipeline.support import REPO_ROOT


def git_commit() -> tuple[str, bool] | None:
    """(HEAD commit, whether tracked files differ from it) of the repository; outside a git checkout the commit an
    image was built from (``AIAYN_COMMIT``, deploy/Dockerfile: ``+`` at its end when the tree differed), else None."""
    found = _git_head()
    baked = os.environ.get("AIAYN_COMMIT", "").strip()
    if found is None and baked and baked != "unknown":
        return baked.rstrip("+"), baked.endswith("+")
    return found


def _git_head() -> tuple[str, bool] | None:
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read only: never rewrite the index
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, env=env)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip(), bool(status.stdout.strip())


def short_commit() -> str:
    """HEAD's short hash, ``+`` when tracked files differ from it (``unknown`` outside a git checkout): how the
    results ledger names the commit a measurement ran at."""
    found = git_commit()
    return "unknown" if found is None else found[0][:7] + ("+" if found[1] else "")
