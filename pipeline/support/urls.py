"""A server's URL as messages and links show it: never the credentials it may carry.

A tracking or API URL may hold a user and password (``http://user:pw@host``, ``postgresql://user:pw@host/db``)
or a token in its query (``?token=...``, libpq's ``?password=...``), and what a message says reaches logs, the
flow run's state message on a shared server and MLflow. A password that is not percent-encoded can hold ``/``,
``?``, ``#`` or ``@``, so parsing the URL would split it in the wrong place and show part of it: everything up to
the last ``@`` is taken as credentials and hidden, and everything from the first ``?`` or ``#``.
"""

from __future__ import annotations


def shown_url(url: str, *, link: bool = False) -> str:
    """``url`` without its credentials and query: ``***@`` marks hidden credentials and ``?...`` a hidden query,
    unless ``link`` (an address to open, whose reader logs in there): then both are left out. A ``?`` or ``#``
    before the last ``@`` may be a password's as well as a query's: then nothing after the scheme is shown."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # no authority (e.g. a bare path): only a query or fragment could hold a secret
        scheme, rest = "", url
    start = rest.rfind("@") + 1
    end = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    if end < start:
        return f"{scheme}{sep}" + ("" if link else "***")
    shown = rest[start:end]
    if not link:
        shown = ("***@" if start else "") + shown + ("?..." if end < len(rest) else "")
    return f"{scheme}{sep}{shown}"
