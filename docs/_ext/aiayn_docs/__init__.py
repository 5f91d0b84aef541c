"""The docs site's own Sphinx extension: before reading any page, the build fails when a generated page (the
reference, the ledger, the current results, README's "What you get" table) or a results plot is stale
(``python docs/generate.py`` rewrites them, and they are committed, so that the docs read the same on GitHub as on
the site).

A ledger entry is cited as a plain Markdown link, ``[L23](../results/ledger.md#l23)``: GitHub and the site both
render it, the strict build fails on an anchor that does not exist, and ``tests/test_docs.py`` checks that every
such link names the entry it points at.
"""

from __future__ import annotations

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

from . import reference


def _prepare(app: Sphinx) -> None:
    stale = reference.stale()
    if stale:
        raise ExtensionError(f"generated pages are stale: {', '.join(stale)}; run `python docs/generate.py`")


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", _prepare)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
