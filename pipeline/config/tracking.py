"""The ``tracking`` section: the MLflow experiment, the registered model and the promotion rule."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import DisplayName, Strict


class TrackingConfig(Strict):
    """MLflow experiment, registered model and promotion rule. The server address is not configuration but
    environment (``MLFLOW_TRACKING_URI``): the same config runs against any tracking server.

    Promotion (the ``champion`` alias, which serving follows): a new version replaces the champion only when,
    on the promotion set ``promote_on``, its ``promote_metric`` beats the champion's by more than
    ``promote_margin`` AND the difference is significant (sacreBLEU's paired bootstrap resampling over the
    set's segments, ``promote_resamples`` resamples, p < ``promote_p``), and no reported test set loses more
    than ``guard_margin`` (chrF for translation, EVALB F1 for parsing). Not in the paper; a registry rule.
    """

    experiment: DisplayName = Field(default="aiayn", min_length=1, description=(
        "The MLflow experiment runs are logged to. Printable characters only."))
    registered_model: DisplayName = Field(default="", description=(
        "The MLflow registered model new versions go to; empty = transformer-<src_lang>-<tgt_lang>. Printable "
        "characters only."))
    promote_on: str = Field(default="dev", min_length=1, description=(
        "The set promotion compares on: dev (the in-domain dev set, data.dev) or the name of a test set (allowed; "
        "the decision then says it selected on a test set, whose reported score is no longer unbiased)."))
    promote_metric: Literal["auto", "sacrebleu", "chrf", "f1"] = Field(default="auto", description=(
        "The score promotion compares; auto = sacrebleu for translation, f1 (EVALB, labelled) for parsing."))
    promote_margin: float = Field(default=0.0, ge=0, description=(
        "How many points of promote_metric a new version must beat the champion by; 0 = any improvement."))
    promote_p: float = Field(default=0.05, gt=0, le=1, description=(
        "Significance level of the paired bootstrap test: the improvement must have p below this."))
    promote_resamples: int = Field(default=1000, ge=100, description=(
        "Resamples of the paired bootstrap test over the promotion set's segments."))
    guard_margin: float = Field(default=1.0, ge=0, description=(
        "Largest allowed drop, in points (chrF for translation, EVALB F1 for parsing), on any reported test set; "
        "a larger drop blocks promotion."))
    attention_sentences: int = Field(default=3, ge=0, description=(
        "Dev sentences whose attention is logged as heat-maps; 0 = none."))
