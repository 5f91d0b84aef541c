"""The trainer's metrics sink for MLflow: buffered, sent from a background thread, retried, never dropped.

Training never waits on the tracking server: :meth:`MlflowSink.log_metrics` appends to a buffer; a thread sends
the buffer every ``flush_every_s`` in MLflow-sized batches and removes only what the server accepted. A failed
send (server restarting, network blip) is retried with exponential backoff, keeping every metric; ``close``
sends the rest and raises :class:`TrackingError` if it cannot within ``close_timeout_s`` (the metrics are also in
the run folder's ``metrics.jsonl``). The same thread samples system metrics (CPU, RAM, and GPU where MLflow's
NVIDIA/ROCm monitor finds one) under ``system/``, the names MLflow's UI shows in its system metrics tab.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
from mlflow.tracking import MlflowClient

from pipeline.support.urls import shown_url

from .runs import BATCH_METRICS, BATCH_PARAMS, TrackingError, check_reachable, chunked, flatten

log = logging.getLogger("aiayn.tracking")


def _system_monitors() -> list[BaseMetricsMonitor]:
    monitors: list[BaseMetricsMonitor] = [CPUMonitor()]
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

        monitors.append(GPUMonitor())  # raises without an NVIDIA GPU (or without pynvml)
    except Exception:
        log.debug("no NVIDIA GPU monitor: GPU system metrics are not logged", exc_info=True)
    return monitors


class MlflowSink:
    """A :class:`pipeline.train.metrics.MetricsSink` that logs into the MLflow run ``run_id`` (rank 0 only).

    Creating it checks that the server answers (raises :class:`TrackingError` at once otherwise).
    """

    def __init__(self, run_id: str, tracking_uri: str, *, flush_every_s: float = 5.0,
                 system_metrics_every_s: float | None = 10.0, max_backoff_s: float = 60.0,
                 close_timeout_s: float = 300.0):
        check_reachable(tracking_uri)
        self.run_id, self.tracking_uri = run_id, tracking_uri
        self._shown_uri = shown_url(tracking_uri)  # what messages name: never the URL's credentials
        self._client = MlflowClient(tracking_uri)
        run = self._client.get_run(run_id)  # a wrong run id fails here, not in the background
        # A resumed training logs again the steps it trains again (values equal: the resume is exact). MLflow keeps
        # every point, so each key's steps already in the run are skipped, leaving each step in it once.
        self._logged_through = {key: max(m.step for m in self._client.get_metric_history(run_id, key))
                                for key in run.data.metrics}
        self._flush_every_s, self._max_backoff_s, self._close_timeout_s = flush_every_s, max_backoff_s, close_timeout_s
        self._metrics: list[Metric] = []
        self._params: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._last_error: Exception | None = None
        self._monitors = _system_monitors() if system_metrics_every_s else []
        self._system_every_s = system_metrics_every_s or 0.0
        self._system_step = 1 + max((v for k, v in self._logged_through.items() if k.startswith("system/")),
                                    default=-1)
        self._next_sample = time.monotonic()
        self.sent = 0  # metrics the server accepted (for reports and tests)
        self._thread = threading.Thread(target=self._run, name="mlflow-sink", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------- MetricsSink

    def log_params(self, params: dict[str, Any]) -> None:
        with self._lock:
            self._params.update(flatten(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        with self._lock:
            self._metrics.extend(Metric(k, float(v), now, step) for k, v in metrics.items()
                                 if step > self._logged_through.get(k, -1))

    def close(self) -> None:
        """Send everything still buffered (retrying up to ``close_timeout_s``); safe to call twice."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join()
        if self.pending():
            raise TrackingError(f"{self.pending()} metrics/params could not be sent to the MLflow server "
                                f"{self._shown_uri} (run {self.run_id}) within {self._close_timeout_s:.0f} s "
                                f"(last error: {self._last_error}); they are in the run folder's metrics.jsonl")

    # -------------------------------------------------------------------------------------------- sending

    def pending(self) -> int:
        """Metrics and params not yet accepted by the server."""
        with self._lock:
            return len(self._metrics) + len(self._params)

    def _sample_system(self) -> None:
        if not self._monitors or time.monotonic() < self._next_sample:
            return
        self._next_sample = time.monotonic() + self._system_every_s
        values: dict[str, float] = {}
        for m in self._monitors:
            m.collect_metrics()
            values.update(m.aggregate_metrics())
            m.clear_metrics()
        self.log_metrics({f"system/{k}": v for k, v in values.items()}, self._system_step)
        self._system_step += 1

    def _send(self) -> None:
        """Send params, then metrics in batches; each batch leaves the buffer only once the server took it."""
        with self._lock:
            params = dict(self._params)
        if params:
            # A resumed training logs its params again: params are immutable in MLflow, so send only new keys
            # and report changed values (e.g. another world size after a restart) instead of failing.
            logged = self._client.get_run(self.run_id).data.params
            changed = {k: (logged[k], v) for k, v in params.items() if k in logged and logged[k] != v}
            if changed:
                log.warning("run %s already has these params with other values (kept): %s", self.run_id, changed)
            for batch in chunked([Param(k, v) for k, v in params.items() if k not in logged], BATCH_PARAMS):
                self._client.log_batch(self.run_id, params=batch)
            with self._lock:
                for k in params:
                    self._params.pop(k, None)
        while True:
            with self._lock:
                batch = self._metrics[:BATCH_METRICS]  # new metrics are appended: this prefix stays put
            if not batch:
                return
            self._client.log_batch(self.run_id, metrics=batch)
            with self._lock:
                del self._metrics[: len(batch)]
            self.sent += len(batch)

    def _run(self) -> None:
        backoff = 0.0
        deadline = None
        while True:
            if self._closing.is_set():
                deadline = deadline or time.monotonic() + self._close_timeout_s
                if backoff:
                    time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            else:
                tick = min(self._flush_every_s, self._system_every_s or self._flush_every_s)
                self._closing.wait(backoff or tick)
            try:
                self._sample_system()
                self._send()
                if backoff:
                    log.info("MLflow logging recovered: buffered metrics sent to run %s", self.run_id)
                backoff = 0.0
            except Exception as e:  # noqa: BLE001 - any failure to send is retried; nothing is dropped
                self._last_error = e
                backoff = min(max(2 * backoff, 1.0), self._max_backoff_s)
                log.warning("MLflow logging to %s failed (%s: %s); %d kept, retrying in %.0f s", self._shown_uri,
                            type(e).__name__, e, self.pending(), backoff)
            if self._closing.is_set() and (not backoff or time.monotonic() >= deadline):
                return
