"""A background prefetcher: one daemon thread runs an iterator a few items ahead.

    for batch in Prefetcher(batches(), depth=2):   # the thread reads while this loop computes
        ...

Its own module (not in loader.py) because ``ember data prepare`` uses it too and must not
import torch.

A thread, not processes: the work it hides (memmap reads, pinned host copies, reading and
cleaning source files) releases the GIL or waits on I/O, and a thread needs no pickling.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

_DONE = object()


class Prefetcher:
    """Iterate ``items`` in a daemon thread, up to ``depth`` items ahead, through a bounded
    queue; iterating the Prefetcher yields them in order. An error in the thread is raised
    by the consumer; ``stop()`` (or leaving the loop) ends the thread without waiting on a full queue."""

    def __init__(self, items: Iterable, depth: int = 2, name: str = "ember-prefetch"):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(items),), name=name, daemon=True)
        self._thread.start()

    def _run(self, items: Iterator) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as exc:  # handed to the consumer, who re-raises it
            self._put(exc)

    def _put(self, item) -> bool:
        while not self._stop.is_set():  # poll so stop() never waits on a full queue
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> Iterator:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the prefetch thread stopped without a result") from None
                    continue
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
