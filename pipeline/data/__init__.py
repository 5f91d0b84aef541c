"""The data stage: read, clean and version a parallel corpus (see docs/explanation/formats.md for the output)."""

from pipeline.data.corpus import CORPUS_FORMAT, corpus_fingerprint, prepare_corpus, read_manifest
from pipeline.data.sources import DataError

__all__ = ["CORPUS_FORMAT", "DataError", "corpus_fingerprint", "prepare_corpus", "read_manifest"]
