"""The base of every error that means bad input or configuration rather than a bug.

The command lines (``python -m pipeline``, ``python -m pipeline.train``) report a :class:`UserError` as one line
and exit status 2, without a traceback; each stage raises its own subclass (``ConfigError``, ``DataError``, ...),
whose message names the file, line or field and what to do.
"""


class UserError(Exception):
    """Bad input or configuration; the message says where and what to do."""
