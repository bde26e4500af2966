"""The consumer side of a submitted job: an iterable TokenStream with cancel()."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pipeserve.engine.output.channel import Channel
from pipeserve.events import Event, KeepAlive, Usage


class EngineStream:
    """Yields the engine's events for one job until (and including) its Usage.

    While nothing arrives for `keepalive_interval` seconds (queue wait, long prefill)
    it yields KeepAlive. Abandoning the iteration early (the HTTP layer closed the
    generator) cancels the job, so nothing keeps decoding for nobody.
    """

    def __init__(
        self,
        channel: Channel,
        on_cancel: Callable[[], None],
        keepalive_interval: float | None = None,
    ) -> None:
        self.channel = channel
        self.keepalive_interval = keepalive_interval
        self._on_cancel = on_cancel
        self._cancelled = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def __iter__(self) -> Iterator[Event]:
        try:
            while not self._done:
                batch = self.channel.get(self.keepalive_interval)
                if batch is None:
                    yield KeepAlive()
                    continue
                for event in batch:
                    if isinstance(event, Usage):
                        self._done = True
                    yield event
        finally:
            if not self._done:
                self.cancel()

    def cancel(self) -> None:
        """Ask the engine to drop this job; it answers with Finish("cancelled") + Usage."""
        if self._cancelled or self._done:
            return
        self._cancelled = True
        self._on_cancel()
