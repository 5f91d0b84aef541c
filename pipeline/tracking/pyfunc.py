"""The served model: an MLflow pyfunc that takes raw source sentences and returns translations.

It bundles the averaged checkpoint, the tokenizer folder, the decoding settings and the text normalisation the
data stage applied (both in the model config), and the code of ``model/`` and ``pipeline/``, so that
``mlflow models serve -m models:/transformer-en-de@champion`` needs only the pinned requirements.
"""

from __future__ import annotations

from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, DataType, Schema

from pipeline.config import REPO_ROOT, CleaningConfig, DecodeConfig
from pipeline.data.clean import Normalizer
from pipeline.inference import load_model, translate
from pipeline.tokenize import Tokenizer

# One unnamed string column: pyfunc then accepts a list of strings, a single string, or a DataFrame whose first
# column holds the sentences (whatever its name), and so does the REST server ({"inputs": [...]},
# {"dataframe_records": [{"source": ...}]}).
SIGNATURE = ModelSignature(inputs=Schema([ColSpec(DataType.string)]), outputs=Schema([ColSpec(DataType.string)]))
# What the model's code imports at inference, pinned to the versions it was logged with. Explicit requirements
# also spare MLflow inferring them (which loads the model in a subprocess: seconds per log).
REQUIREMENTS = ("torch", "numpy", "pyarrow", "pydantic", "PyYAML", "sentencepiece", "sacrebleu", "sacremoses",
                "tqdm", "pandas", "mlflow")


def pip_requirements() -> list[str]:
    """``name==version`` for each of :data:`REQUIREMENTS` as installed here."""
    return [f"{name}=={version(name)}" for name in REQUIREMENTS]


def code_paths() -> list[str]:
    """The project's packages the model's code needs."""
    return [str(REPO_ROOT / "model"), str(REPO_ROOT / "pipeline")]


def source_sentences(model_input: Any) -> list[str]:
    """Raw sentences from what pyfunc passes: a DataFrame (first column), a list or a single string."""
    if isinstance(model_input, pd.DataFrame):
        return [str(s) for s in model_input.iloc[:, 0]]
    if isinstance(model_input, str):
        return [model_input]
    return [str(s) for s in model_input]


class Translator(mlflow.pyfunc.PythonModel):
    """Raw source sentences in, detokenized translations out (beam search with the logged decoding settings)."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        self.model = load_model(Path(context.artifacts["checkpoint"]))
        self.tokenizer = Tokenizer(Path(context.artifacts["tokenizer"]))
        self.decode = DecodeConfig.model_validate(context.model_config["decode"], strict=False)
        # The normalisation the training data had (NFC, whitespace), so that raw input matches it.
        self.normalize = Normalizer(CleaningConfig.model_validate(context.model_config["cleaning"], strict=False),
                                    Counter())

    # model_input is left unannotated: MLflow would read a type hint as a schema that overrides the signature.
    def predict(self, context: mlflow.pyfunc.PythonModelContext, model_input, params: dict[str, Any] | None = None):
        sentences = [self.normalize(s) for s in source_sentences(model_input)]
        return translate(self.model, self.tokenizer, sentences, self.decode)
