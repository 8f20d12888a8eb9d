"""Work handed to a thread of its own and done there in the order given: the cpu model's streamed responses.

Each response a decoupled Python model sends is a round trip to Triton's server process (the stub waits until the
server has taken it), and asking whether a request was cancelled is another. Measured on the cpu target
(SmolLM2, ONNX Runtime, 8 streaming clients on 2 cores, `trtpipe profile`): 0.8 ms a send and 0.23 ms a
cancellation check, for every token of every row, while the decode step waited. The worker now hands both to an
`Outbox` and goes on computing the next step; the order of one request's responses is the order they were put.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Outbox:
    """A FIFO of callables run by one daemon thread, until `close` (which waits for everything put before it)."""

    def __init__(self, name: str = "outbox"):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def wait(self) -> None:
        """Until everything put so far has been done."""
        self._queue.join()

    def close(self, timeout: float | None = None) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                if work is None:
                    return
                work()
            except Exception:   # one failed send must not stop the responses of every other request
                log.exception("outbox: %r failed", work)
            finally:
                self._queue.task_done()
