"""Work in a gevent thread pool: results and exceptions come back to the caller, and an
expected exception (a 400's cause) leaves no traceback in the server's log."""

from __future__ import annotations

import pytest
from gevent.threadpool import ThreadPool

from pipeserve.gevent_support import apply_in_pool


class Expected(ValueError):
    pass


def refuse(what: str) -> str:
    raise Expected(what)


def test_result_and_exception_come_back_without_a_printed_traceback(
    capfd: pytest.CaptureFixture[str],
) -> None:
    pool = ThreadPool(1)
    try:
        assert apply_in_pool(pool, str.upper, "ok") == "OK"
        with pytest.raises(Expected, match="no such schema type"):
            apply_in_pool(pool, refuse, "no such schema type")
        assert apply_in_pool(pool, len, "still serving") == 13
    finally:
        pool.kill()
    printed = capfd.readouterr().err
    assert "Expected" not in printed and "Traceback" not in printed
