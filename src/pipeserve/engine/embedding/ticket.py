"""The request side of a submitted embedding job: wait for its result, or cancel it."""

from __future__ import annotations

from collections.abc import Callable

from pipeserve.engine.embedding.jobs import EmbedResult
from pipeserve.engine.embedding.mailbox import Mailbox


class EmbedTicket:
    """The request side of a submitted job: wait for its result, or cancel it."""

    def __init__(self, mailbox: Mailbox, cancel: Callable[[], None]) -> None:
        self._mailbox = mailbox
        self._cancel = cancel
        self._done: list[Callable[[], None]] = []

    def on_done(self, callback: Callable[[], None]) -> None:
        self._done.append(callback)

    def wait(self, timeout: float) -> EmbedResult | None:
        """The result, or None after `timeout` seconds (the job is then cancelled)."""
        result = self._mailbox.get(timeout)
        if result is None:
            self.cancel()
        self._finish()
        return result

    def cancel(self) -> None:
        self._cancel()
        self._finish()

    def _finish(self) -> None:
        callbacks, self._done = self._done, []
        for callback in callbacks:
            callback()
