"""The served model: an MLflow pyfunc that takes raw source sentences and returns translations (a parser's: trees).

It bundles the averaged checkpoint, the tokenizer folder, the CTranslate2 export when it passed the export gate
(``pipeline.export``), the decoding settings and the text normalisation the data stage applied (both in the model
config), and the code of ``model/`` and ``pipeline/``, so that ``mlflow models serve -m
models:/transformer-en-de@champion`` needs only the pinned requirements.

Engine: CTranslate2 when the model carries an export and ``ctranslate2`` imports, else PyTorch; the environment
variable ``AIAYN_SERVING_ENGINE`` (``torch`` / ``ctranslate2``) or the model config's ``engine`` (e.g.
``mlflow.pyfunc.load_model(uri, model_config={"engine": "torch"})``) picks one; which one serves is logged
at load and is the model's ``engine`` attribute. ``AIAYN_SERVING_THREADS``: how many batches CTranslate2 runs side
by side, one thread each (0: one per core).

Per request, through the params schema (``{"inputs": [...], "params": {"beam_size": 1}}``): ``beam_size``,
``alpha`` (length penalty), ``max_len_b`` (output length = source length + max_len_b at most) and ``nbest``
(> 1: each sentence's list of its nbest translations, best first, instead of one string).

Bad requests, through ``mlflow models serve``: a param out of range or of the wrong type, an empty list, an item
that is an object, and a body that is not UTF-8 JSON get a 400 that says what is wrong; the server goes on. An
empty sentence translates to an empty string without decoding; a sentence longer than the model's positions is
cut to them (logged). MLflow's schema enforcement turns JSON numbers, booleans and null into their text ("1",
"True", "None") before the model sees them; those are translated as text.

A parser (``task: parsing`` in the model config, from its checkpoint) takes sentences of ordinary English and
returns one tree per sentence over exactly its words, the user's own as leaves, decoded under the tree constraint
with the PyTorch engine: what ``python -m pipeline translate`` writes with the same settings
(:func:`pipeline.parsing.evaluate.parse_lines`). Its params add ``pretokenized`` (default false: ordinary
English): true reads each sentence as treebank words separated by spaces (``do n't``, ``-LRB-``), parsed and
written as given, as ``translate --pretokenized`` does, so that EVALB can score the served model's trees against
gold ones. A sentence with no word, or ``nbest`` above 1, gets a 400.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

from pipeline.config import REPO_ROOT, CleaningConfig, DecodeConfig
from pipeline.data.clean import Normalizer
from pipeline.engines import Engine, open_engine
from pipeline.parsing.trees import PLACEHOLDER
from pipeline.support.errors import UserError
from pipeline.tokenize import Tokenizer

ENGINE_ENV = "AIAYN_SERVING_ENGINE"
THREADS_ENV = "AIAYN_SERVING_THREADS"
# What the model's code imports at inference, pinned to the versions it was logged with. Explicit requirements
# also spare MLflow inferring them (which loads the model in a subprocess: seconds per log). An environment without
# ctranslate2 still serves, with the PyTorch engine (pipeline.engines.open_engine).
REQUIREMENTS = ("torch", "numpy", "pyarrow", "pydantic", "PyYAML", "sentencepiece", "sacrebleu", "sacremoses",
                "tqdm", "pandas", "mlflow", "ctranslate2", "nltk")
INPUT_EXAMPLE = ["A man in a blue shirt is riding a bicycle.", "Two dogs play in the snow."]
MAX_BEAM = 64  # a request's beam_size at most: a larger beam costs memory and time in proportion
PRETOKENIZED = "pretokenized"  # a parser's param: the sentences are treebank words, not ordinary English


def signature(decode: DecodeConfig, task: str = "translation") -> ModelSignature:
    """One unnamed string column in (pyfunc then accepts a list of strings, a single string, or a DataFrame whose
    first column holds the sentences, and so does the REST server), one string out, and the per-request decoding
    params with the registered settings as defaults; a parser's also take ``pretokenized`` (default: raw
    English)."""
    params = [ParamSpec("beam_size", DataType.long, decode.beam_size),
              ParamSpec("alpha", DataType.double, decode.length_penalty),
              ParamSpec("max_len_b", DataType.long, decode.max_len_b),
              ParamSpec("nbest", DataType.long, 1)]
    if task == "parsing":
        params.append(ParamSpec(PRETOKENIZED, DataType.boolean, False))
    return ModelSignature(inputs=Schema([ColSpec(DataType.string)]), outputs=Schema([ColSpec(DataType.string)]),
                          params=ParamSchema(params))


def pip_requirements() -> list[str]:
    """``name==version`` for each of :data:`REQUIREMENTS` as installed here."""
    return [f"{name}=={version(name)}" for name in REQUIREMENTS]


def code_paths() -> list[str]:
    """The project's packages the model's code needs."""
    return [str(REPO_ROOT / "model"), str(REPO_ROOT / "pipeline")]


def model_arguments(checkpoint: Path, tokenizer_dir: Path, decode: DecodeConfig, cleaning: dict,
                    export: Path | None = None, task: str = "translation",
                    tree_leaves: str = PLACEHOLDER) -> dict[str, Any]:
    """What logging (or saving) the served model's pyfunc takes: the artifacts (checkpoint, tokenizer and the
    CTranslate2 ``export`` when given, which then is the engine it serves with), model config (with the
    checkpoint's ``task`` and, for parsing, how it writes leaves: ``data.tree_leaves``), code, requirements,
    signature and input example."""
    artifacts = {"checkpoint": str(checkpoint), "tokenizer": str(tokenizer_dir)}
    if export is not None:
        artifacts["ctranslate2"] = str(export)
    engine = "torch" if export is None else "ctranslate2"
    return {"python_model": ServedModel(), "artifacts": artifacts,
            "model_config": {"decode": decode.model_dump(mode="json"), "cleaning": cleaning, "engine": engine,
                             "task": task, "tree_leaves": tree_leaves},
            "code_paths": code_paths(), "pip_requirements": pip_requirements(), "signature": signature(decode, task),
            "input_example": INPUT_EXAMPLE}


def save_translator(folder: Path, checkpoint: Path, tokenizer_dir: Path, decode: DecodeConfig, cleaning: dict,
                    export: Path | None = None) -> Path:
    """The translator pyfunc saved to a local ``folder`` (what ``mlflow models serve -m`` serves), without its
    input example: validating that loads the model in this process."""
    arguments = model_arguments(checkpoint, tokenizer_dir, decode, cleaning, export)
    arguments.pop("input_example")
    mlflow.pyfunc.save_model(str(folder), **arguments)
    return folder


def _bad_request(message: str) -> MlflowException:
    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)  # the scoring server answers 400


def source_sentences(model_input: Any) -> list[str]:
    """Raw sentences from what pyfunc passes: a DataFrame (first column), a list or a single string; anything
    that is not a string is refused (a 400 from the server) rather than translated as its repr."""
    if isinstance(model_input, pd.DataFrame):
        items = list(model_input.iloc[:, 0]) if model_input.shape[1] else []
    elif isinstance(model_input, str):
        items = [model_input]
    else:
        items = list(model_input)
    wrong = [(i, item) for i, item in enumerate(items) if not isinstance(item, str)]
    if wrong:
        i, item = wrong[0]
        raise _bad_request(f"input item {i} is {type(item).__name__} {item!r}, not a string: send sentences as "
                           'strings, e.g. {"inputs": ["A man is riding a bicycle."]}')
    return items


def request_decoding(decode: DecodeConfig, params: dict[str, Any] | None,
                     max_positions: int) -> tuple[DecodeConfig, int]:
    """The registered decoding settings with a request's params applied, and its nbest; a clear 400 for a
    value out of range."""
    params = dict(params or {})
    nbest = int(params.pop("nbest", 1))
    beam = int(params.get("beam_size", decode.beam_size))
    limits = {"beam_size": (1, MAX_BEAM), "max_len_b": (0, max_positions - 1), "alpha": (0.0, 10.0)}
    for key, value in params.items():
        if key not in limits:
            raise _bad_request(f"unknown param {key!r}: the model takes beam_size, alpha, max_len_b and nbest")
        low, high = limits[key]
        if not low <= value <= high:
            raise _bad_request(f"param {key}={value!r} is out of range: it must be in [{low}, {high}]")
    if not 1 <= nbest <= beam:
        raise _bad_request(f"param nbest={nbest} must be in [1, beam_size={beam}]: a beam of {beam} finds at most "
                           f"{beam} translations")
    fields = {"beam_size": "beam_size", "alpha": "length_penalty", "max_len_b": "max_len_b"}
    return decode.model_copy(update={fields[k]: v for k, v in params.items()}), nbest


class ServedModel(mlflow.pyfunc.PythonModel):
    """A registered translator or parser as MLflow serves it: raw source sentences in, detokenized translations
    (a parser: trees) out, with the engine chosen at load (see the module docstring)."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        if not logging.getLogger("aiayn").hasHandlers():  # a bare server (mlflow models serve): log to stderr
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger("aiayn").addHandler(handler)
            logging.getLogger("aiayn").setLevel(logging.INFO)
        config = context.model_config
        tokenizer = Tokenizer(Path(context.artifacts["tokenizer"]))
        self.decode = DecodeConfig.model_validate(config["decode"], strict=False)
        # The normalisation the training data had (NFC, whitespace), so that raw input matches it.
        self.normalize = Normalizer(CleaningConfig.model_validate(config["cleaning"], strict=False), Counter())
        # models logged before parsing was served have neither key: they are translators
        self.task, self.tree_leaves = config.get("task", "translation"), config.get("tree_leaves", PLACEHOLDER)
        export = context.artifacts.get("ctranslate2")
        self.engine: Engine = open_engine(os.environ.get(ENGINE_ENV) or config.get("engine", "torch"),
                                          Path(context.artifacts["checkpoint"]), tokenizer,
                                          Path(export) if export else None, int(os.environ.get(THREADS_ENV, "0")))

    # model_input is left unannotated: MLflow would read a type hint as a schema that overrides the signature.
    def predict(self, context: mlflow.pyfunc.PythonModelContext, model_input, params: dict[str, Any] | None = None):
        params = dict(params or {})
        # a parser's param only: a translator's signature has none, and request_decoding refuses it
        pretokenized = bool(params.pop(PRETOKENIZED, False)) if self.task == "parsing" else False
        decode, nbest = request_decoding(self.decode, params, self.engine.max_positions)
        sentences = [self.normalize(s) for s in source_sentences(model_input)]
        if self.task == "parsing":
            return self._parse(sentences, decode, nbest, pretokenized)
        out = self.engine.translate(sentences, decode, nbest)  # an empty sentence: "" (pipeline.encoding.to_decode)
        return [best[0] for best in out] if nbest == 1 else out

    def _parse(self, sentences: list[str], decode: DecodeConfig, nbest: int, pretokenized: bool) -> list[str]:
        """One tree per sentence of English, or of treebank words when ``pretokenized``
        (:func:`pipeline.parsing.evaluate.parse_lines`), decoded by the PyTorch engine's model (a parser is never
        exported)."""
        from pipeline.parsing.evaluate import parse_lines  # torch: a translator served by CTranslate2 never loads it

        if nbest != 1:
            raise _bad_request(f"param nbest={nbest}: a parser returns one tree per sentence; leave nbest at 1")
        try:
            return parse_lines(self.engine.model, self.engine.tokenizer, sentences, decode, self.tree_leaves,
                               pretokenized=pretokenized, source="request")
        except UserError as e:  # a sentence with no word
            raise _bad_request(str(e)) from None


# A registered model's python_model.pkl names its class by import path; those logged before the rename name
# pipeline.tracking.pyfunc.Translator, which a process that has imported this module (rather than the model's own
# copy of the code) resolves here.
Translator = ServedModel
