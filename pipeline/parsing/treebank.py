"""The Penn Treebank as a data source: the words are the source sentence, the linearised tree the model target.

A reader of the data stage (``pipeline.data.sources.Source``, format ``ptb``), kept with the parsing code it reads
trees with; the data stage finds it through ``pipeline.data.sources.TASK_READERS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa

from pipeline.data.sources import DataError, Pair, Source, existing_file
from pipeline.data.sources.lines import Lines
from pipeline.parsing.trees import Tree, TreeError, clean, linearize, parse_tree, read_trees, target_symbols


def read_tree_file(path: Path, on_bom: Callable[[Path], None] | None = None) -> Iterator[tuple[int, Tree]]:
    """The trees of a treebank file (:func:`~pipeline.parsing.trees.read_trees`), its lines read as every text
    input is (:class:`~pipeline.data.sources.lines.Lines`: a byte order mark dropped and told to ``on_bom``, bad
    UTF-8 or a NUL byte a :class:`DataError` naming the line)."""
    with Lines(path, on_bom) as lines:
        yield from read_trees((text for _, text in lines), str(path))


class PtbSource(Source):
    """Penn Treebank trees (``.mrg`` files or one tree per line): ``path`` a file, or a folder + ``include`` globs.

    Yields ``(n, words, tree)``: ``n`` counts the source's trees from 1 (files in sorted path order), ``words``
    are the tree's words without ``-NONE-`` elements, ``tree`` the gold tree as distributed on one line (scored
    against). :meth:`model_target` gives the linearised, cleaned tree the model learns (pipeline.parsing.trees).
    """

    def __init__(self, *args: Any):
        super().__init__(*args)
        path = self._inside(self.spec.path, "path")
        if self.spec.include:
            if not path.is_dir():
                raise DataError(f"{self.where}: 'include' needs 'path' to be a folder, but {path} is not one")
            matched = {self._inside(m, f"include (pattern {pattern!r})")
                       for pattern in self.spec.include for m in path.glob(pattern)}
            self.paths = sorted(p for p in matched if p.is_file())
            if not self.paths:
                raise DataError(f"{self.where}: no file under {path} matches include {self.spec.include}; check "
                                "data.root and the patterns (e.g. WSJ sections: '0[2-9]/*.mrg')")
            for p in self.paths:
                existing_file(p, self.where)
        else:
            if path.is_dir():
                raise DataError(f"{self.where}: {path} is a folder; give 'include' patterns selecting its tree files")
            self.paths = [existing_file(path, self.where)]
        # Tree files are read as plain text: a .gz would only fail later as "not UTF-8".
        if gz := next((p for p in self.paths if p.suffix == ".gz"), None):
            raise DataError(f"{gz}: format ptb reads plain-text tree files, not gzip; decompress it (gunzip -k "
                            f"{gz.name}) and select the decompressed file in {self.where}")
        self.info.location = {"path": self._rel(path), "include": ",".join(self.spec.include or [])}
        self._record_files(self.paths)

    def pairs(self) -> Iterator[Pair]:
        n = 0
        for path in self.paths:
            try:
                for line, tree in read_tree_file(path, self._bom):
                    cleaned = clean(tree)
                    if cleaned is None:
                        raise DataError(f"{path}: line {line}: the tree has no word besides -NONE- elements; "
                                        "it cannot be parsed or scored, remove it")
                    n += 1
                    yield n, " ".join(cleaned.words()), str(tree)
            except TreeError as e:
                raise DataError(str(e)) from None
        self.info.rows_read = n

    def model_target(self, tgt: str, tree_leaves: str) -> str:
        return linearize(clean(parse_tree(tgt)), tree_leaves)

    def target_symbols(self, targets: pa.StringArray) -> set[str]:
        return set().union(*map(target_symbols, targets.to_pylist()))
