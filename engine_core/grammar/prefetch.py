"""The grammar engine's import, made once per server process off the event loop.

Importing xgrammar takes a second or more of CPU (it pulls in torch). A server makes the
import on a daemon thread, either ``delay_s`` after it starts listening or as soon as a
request needs a grammar, whichever comes first; such a request awaits the import instead of
blocking the event loop on it. The delay keeps the import out of startup, where it competes
with the engine process's own start for the CPU, and out of processes that stop before they
ever serve a constrained request; an infinite delay (``--grammar-import-delay inf``) keeps
it (about 240 MB of memory) out of workers that never serve one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import math
import threading
from collections.abc import Callable

from engine_core.grammar.spec import import_grammar_engine

logger = logging.getLogger(__name__)


class GrammarEngineImport:
    """One import of the grammar engine: ``start`` runs it on a daemon thread (once),
    ``ready`` awaits it. With ``freeze_heap`` (a server process), what it imported joins
    the objects ``gc.freeze()`` keeps out of the collector's walks."""

    def __init__(self, freeze_heap: bool = False,
                 importer: Callable[[], None] = import_grammar_engine) -> None:
        self._freeze_heap = freeze_heap
        self._importer = importer
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread: threading.Thread | None = None  # started on the event loop's thread

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Begin the import unless it has begun. A daemon thread, not the loop's executor:
        a server stopped while the import runs exits at once."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="grammar-import", daemon=True)
        self._thread.start()

    def start_after(self, delay_s: float) -> asyncio.TimerHandle | None:
        """Begin the import ``delay_s`` from now (on the running loop); ``inf``: never on its
        own, only when a request awaits ``ready``."""
        if delay_s == math.inf:
            return None
        return asyncio.get_running_loop().call_later(delay_s, self.start)

    async def ready(self) -> None:
        """Return once the import has ended (started now if it had not); a failed import
        is logged, and the grammar code then imports again and reports its own error."""
        self.start()
        await asyncio.wrap_future(self._done)

    def _run(self) -> None:
        try:
            self._importer()
        except Exception as exc:
            logger.warning("importing the grammar engine failed (constrained requests will "
                           "try again): %r", exc)
        if self._freeze_heap:
            gc.freeze()
        self._done.set_result(None)
