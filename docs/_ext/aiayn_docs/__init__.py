"""The docs site's own Sphinx extension.

- ``{ledger}`L23``` cites a results-ledger entry: a link to it, and a build error when the id does not exist.
- Before reading any page, the build fails when a generated reference page is stale (``python docs/generate.py``
  rewrites them) and draws the results plots from the committed result files into ``docs/results/plots/``.
"""

from __future__ import annotations

import posixpath

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

from . import ledger, plots, reference

log = logging.getLogger(__name__)
LEDGER_DOC = "results/ledger"
_IDS: set[str] = set()


def _ledger_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    eid = text.strip()
    env = inliner.document.settings.env
    known = _IDS  # set once per build, in _prepare
    if eid not in known:
        msg = inliner.reporter.error(f"{{ledger}}`{eid}`: no such entry in docs/results/ledger.yaml", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    here = posixpath.dirname(env.docname)
    uri = posixpath.relpath(LEDGER_DOC, here or ".") + ".html#" + eid.lower()
    return [nodes.reference(rawtext, eid, refuri=uri, classes=["ledger-ref"])], []


def _prepare(app: Sphinx) -> None:
    stale = reference.stale()
    if stale:
        raise ExtensionError(f"generated pages are stale: {', '.join(stale)}; run `python docs/generate.py`")
    led = ledger.load(reference.LEDGER)
    _IDS.clear()
    _IDS.update(led.ids)
    made = plots.render_all(led, reference.REPO, reference.DOCS / "results" / "plots")
    log.info(f"[aiayn_docs] {len(made)} plots drawn from the ledger's result files")


def setup(app: Sphinx) -> dict:
    app.add_role("ledger", _ledger_role)
    app.connect("builder-inited", _prepare)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
