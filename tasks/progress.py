"""Progress artifacts of long stages, updated on progress, not on a clock.

Every update of a Prefect artifact is an event that ``prefect deployment run --watch`` prints as a line. An
update here is sent only when the stage has advanced by at least ``min_points`` percentage points AND
``min_seconds`` have passed since the last one (and at the end): at most 100 updates, and at most one a minute.
"""

from __future__ import annotations

import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact


class Throttle:
    """Which progress values are worth an update: those ``min_points`` past the last one sent, ``min_seconds``
    after it, and 100 once."""

    def __init__(self, min_points: float = 1.0, min_seconds: float = 60.0, now: float | None = None):
        self.min_points, self.min_seconds = min_points, min_seconds
        self.sent, self.sent_at = 0.0, time.monotonic() if now is None else now

    def due(self, percent: float, now: float | None = None) -> bool:
        """Whether ``percent`` is to be sent at ``now`` (monotonic seconds); if so it counts as sent."""
        now = time.monotonic() if now is None else now
        due = percent >= 100.0 > self.sent or (percent - self.sent >= self.min_points
                                                 and now - self.sent_at >= self.min_seconds)
        if due:
            self.sent, self.sent_at = percent, now
        return due


class ProgressArtifact:
    """A flow run's progress artifact ``key`` (0-100), updated through a :class:`Throttle`; as a context manager,
    finished (100) when its block ends without an error, also when the stage found its output there already."""

    def __init__(self, key: str, description: str, throttle: Throttle | None = None):
        self.id = create_progress_artifact(progress=0.0, key=key, description=description)
        self.throttle = throttle or Throttle()

    def update(self, percent: float) -> None:
        """Report ``percent`` done if it is due."""
        percent = round(min(max(percent, 0.0), 100.0), 1)
        if self.throttle.due(percent):
            update_progress_artifact(self.id, percent)

    def fraction(self, done: float, total: float) -> None:
        """Report ``done`` of ``total`` (a stage's own units: sentences, steps) if it is due."""
        self.update(100.0 * done / total if total else 100.0)

    def finish(self) -> None:
        """100%, once."""
        self.update(100.0)

    def __enter__(self) -> ProgressArtifact:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.finish()
