"""``python -m ops.localstack`` on bad input: one line naming the file, option or address and what to do, never a
traceback: a corrupt ``stack.json``, a ``--home`` that is a file, a port out of range, and ``deploy`` to a
``PREFECT_API_URL`` that is malformed, unreachable or not a Prefect server's API."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from ops.localstack import free_port, main


def _refusal(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: ") and "Traceback" not in out.err
    return out.err


@pytest.mark.parametrize("action", ["status", "down", "up"])
@pytest.mark.parametrize("record", [b'{"mlflow": {"pid": 12', b"\xff\xfe", b"[1, 2]", b'{"mlflow": {"pid": 1}}'])
def test_a_corrupt_stack_record_is_named_with_what_to_do(capsys, tmp_path: Path, action: str, record: bytes) -> None:
    (tmp_path / "stack.json").write_bytes(record)
    err = _refusal(capsys, [action, "--home", str(tmp_path)])
    assert err.startswith(f"error: {tmp_path / 'stack.json'}: not a stack record (") and "delete the file" in err
    assert len(err.splitlines()) == 1
    assert (tmp_path / "stack.json").read_bytes() == record  # kept: it names the processes to stop by hand


@pytest.mark.parametrize("action", ["status", "down", "up"])
@pytest.mark.parametrize("below", ["", "sub"])
def test_a_home_that_is_a_file_is_refused(capsys, tmp_path: Path, action: str, below: str) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    home = file / below if below else file
    err = _refusal(capsys, [action, "--home", str(home)])
    assert err == f"error: --home / AIAYN_STACK_HOME {home}: {file} is a file, not a folder; give the folder where " \
                  "the stack keeps its records (made when missing)\n"
    assert file.read_text() == "mine\n"


@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_a_port_out_of_range_is_refused_by_the_command_line(capsys, tmp_path: Path, port: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["up", "--home", str(tmp_path), "--mlflow-port", port])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --mlflow-port: {port!r} is not a port: give a number from 1 to 65535" in err
    assert not (tmp_path / "stack.json").exists()


class _NotPrefect(http.server.BaseHTTPRequestHandler):
    """A web server that is not Prefect's API: every page a 200 HTML page (as a UI's catch-all route answers)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>hello</html>")

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(("url", "why"), [
    ("localhost:4200/api", "not an http:// or https:// address"),
    ("http://[::1/api", "Invalid IPv6 URL"),
    ("http://127.0.0.1:99999/api", "Port out of range"),
    ("http://127.0.0.1:{free}/api", "no server answers there"),
    ("http://{web}", "answers, but not as a Prefect server's API"),
])
def test_deploy_names_a_prefect_api_url_that_is_no_prefect_server(capsys, monkeypatch, url: str, why: str) -> None:
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotPrefect)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        url = url.format(free=free_port(), web=f"127.0.0.1:{web.server_port}")
        monkeypatch.setenv("PREFECT_API_URL", url)
        err = _refusal(capsys, ["deploy"])
    finally:
        web.shutdown()
    assert err.startswith(f"error: PREFECT_API_URL {url}: ") and why in err and len(err.splitlines()) == 1


def test_deploy_shows_no_password_of_a_prefect_api_url(capsys, monkeypatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", f"http://team:s3cret@127.0.0.1:{free_port()}/api")
    err = _refusal(capsys, ["deploy"])
    assert "s3cret" not in err and "PREFECT_API_URL http://***@127.0.0.1:" in err
