"""The lossy proxy's error reports: a client killed mid-request (chaos kills them) is
expected, anything else is reported as the standard library reports it."""
from __future__ import annotations

from ipcount_lab.lossy_proxy import LossyProxy
from ipcount_lab.service import free_port


def test_a_client_gone_mid_request_is_no_error_and_anything_else_is(capsys):
    proxy = LossyProxy(upstream_port=1, port=free_port(), every=0)
    try:
        for error in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset"), ValueError("bug")):
            try:
                raise error
            except Exception:
                proxy.handle_error(None, ("127.0.0.1", 1))
    finally:
        proxy.server_close()
    err = capsys.readouterr().err
    assert "ValueError: bug" in err and "Broken pipe" not in err and "reset" not in err
