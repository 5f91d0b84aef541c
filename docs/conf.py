"""Sphinx configuration of the docs site (Sphinx + MyST-Parser + Furo): see docs/README.md for why these."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS / "_ext"), str(DOCS.parent)]  # our extension; the project, for the generated reference

project = "aiayn-pipeline"
author = "the aiayn-pipeline developers"
copyright = "2026, " + author

extensions = ["myst_parser", "aiayn_docs"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # GitHub-style anchors for #, ## and ### headings: links work on GitHub and here
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "README.md", "_ext"]
html_theme = "furo"
html_title = "aiayn-pipeline"
html_static_path: list[str] = []
suppress_warnings: list[str] = []  # none: the build runs with -W, and every warning fails it
