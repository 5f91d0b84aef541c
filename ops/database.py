"""The PostgreSQL server a team's stack keeps Prefect's and MLflow's data on: its URL read and checked (an
ambiguous URL refused, naming the character to encode), shown without its password, its databases created; and
the environment every process but the servers gets, without the database settings."""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass


class StackError(RuntimeError):
    """A service did not start, a port is taken or a setting is wrong; the message says which and what to do."""


DATABASES = {"prefect-server": "aiayn_prefect", "mlflow": "aiayn_mlflow"}  # service -> its database on PostgreSQL


@dataclass(frozen=True)
class PostgreSQL:
    """The PostgreSQL server a stack keeps Prefect's and MLflow's data on (one database each: their schemas would
    collide in one, both keeping an ``alembic_version`` table)."""

    user: str
    password: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> PostgreSQL:
        """``postgresql://USER[:PASSWORD]@HOST[:PORT]`` (no database: the stack names its own), or a StackError
        saying what is wrong with it, which shows the URL rebuilt without its password.

        The credentials are what lies between ``//`` and the last ``@``. A character there that a URL reads as
        something else (``/`` a path, ``?`` options, ``#`` a fragment, ``@`` the host, ``:`` the password's start,
        ``%`` an escape, a space or any character a URL does not hold) is refused, naming it and its
        percent-encoding: left in, the URL means another server, or another user and password, to each reader."""
        scheme, sep, rest = url.partition("://")
        userinfo, at, server = rest.rpartition("@")
        given = f"--database-url / AIAYN_DATABASE_URL {_shown(scheme, userinfo, at, server) if sep else '***'}"
        if not sep or scheme not in ("postgresql", "postgres"):
            raise StackError(f"{given}: not a PostgreSQL URL; give postgresql://USER:PASSWORD@HOST:PORT")
        user, _, password = userinfo.partition(":")
        for what, text in (("user name", user), ("password", password)):
            if (bad := _unencoded(text)) is not None:
                raise StackError(f"{given}: the {what} holds {bad!r}, which a URL does not take as it is; "
                                 f"percent-encode it ({bad!r} is {urllib.parse.quote(bad, safe='')}; "
                                 f"python3 -c \"import urllib.parse; print(urllib.parse.quote(input(), safe=''))\" "
                                 f"encodes a whole {what} typed at its prompt)")
        parts = urllib.parse.urlsplit(url)
        if not parts.hostname or not parts.username:
            raise StackError(f"{given}: names no user or host; give postgresql://USER:PASSWORD@HOST:PORT")
        if parts.path.strip("/") or parts.query or parts.fragment:
            raise StackError(f"{given}: name the server only, without a database or options: the stack keeps "
                             f"Prefect in {DATABASES['prefect-server']} and MLflow in {DATABASES['mlflow']} on it")
        try:
            port = parts.port or 5432
        except ValueError as e:
            raise StackError(f"{given}: {e}") from None
        return cls(urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""),
                   parts.hostname, port)

    def url(self, database: str, driver: str = "") -> str:
        """The SQLAlchemy URL of ``database`` (``driver``: e.g. ``asyncpg``, Prefect's)."""
        auth = urllib.parse.quote(self.user, safe="") + (
            ":" + urllib.parse.quote(self.password, safe="") if self.password else "")
        return f"postgresql{'+' + driver if driver else ''}://{auth}@{self.host}:{self.port}/{database}"

    def shown(self, database: str) -> str:
        """The URL of ``database`` as logs and ``stack.json`` show it: without the password."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"

    def ensure(self, database: str) -> None:
        """Create ``database`` when it does not exist (the role needs CREATEDB for that); a StackError naming the
        server and what to do when it cannot be reached or created."""
        import psycopg2  # MLflow's PostgreSQL driver; only this mode needs it
        from psycopg2 import errors

        def connect(db: str):
            return psycopg2.connect(dbname=db, user=self.user, password=self.password, host=self.host,
                                    port=self.port, connect_timeout=10)

        try:
            connect(database).close()
            return
        except psycopg2.OperationalError as e:
            if f'database "{database}" does not exist' not in str(e):
                raise StackError(f"PostgreSQL at {self.shown(database)}: {str(e).strip()}") from None
        try:
            conn = connect("postgres")
            try:  # not `with conn`: that opens a transaction, and CREATE DATABASE cannot run in one
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(f'CREATE DATABASE "{database}"')
            finally:
                conn.close()
        except (psycopg2.OperationalError, errors.InsufficientPrivilege) as e:
            raise StackError(f"PostgreSQL at {self.shown(database)}: the database does not exist and could not be "
                             f"created ({str(e).strip()}); create it (CREATE DATABASE {database} OWNER "
                             f"{self.user}) or give the role CREATEDB") from None


# What a URL's user name or password may hold as it is (RFC 3986's userinfo, less ':' inside the password):
# letters, digits, -._~ and !$&'()*+,;=, or a %XX escape.
_USERINFO = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})*")


def _unencoded(text: str) -> str | None:
    """The first character of a URL's user name or password that must be percent-encoded, or None."""
    end = _USERINFO.match(text).end()
    return None if end == len(text) else text[end]


def _shown(scheme: str, userinfo: str, at: str, server: str) -> str:
    """A database URL as errors show it: the user, never the password, and the server without its options
    (libpq takes a password there too)."""
    if not at:  # no credentials to set apart: all of it may be one
        return f"{scheme}://***"
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{re.split(r'[?#]', server, maxsplit=1)[0]}"


# Settings that hold a database's URL or password: only the server that keeps its data there gets them, and no
# worker, flow run or CLI call of the stack inherits them from the shell that ran `up`.
SERVER_SECRETS = ("AIAYN_DATABASE_URL", "MLFLOW_BACKEND_STORE_URI")
SERVER_SECRET_PREFIXES = ("PREFECT_SERVER_DATABASE_", "PREFECT_API_DATABASE_")


def client_environ() -> dict[str, str]:
    """This process's environment without the servers' database settings (:data:`SERVER_SECRETS`)."""
    return {k: v for k, v in os.environ.items()
            if k not in SERVER_SECRETS and not k.startswith(SERVER_SECRET_PREFIXES)}
