"""One log line per slow phase (load, build, compile), with its time: ``LLM()`` is never silent.

Lines go to the ``llmserve`` logger, which prints INFO to stderr unless the application set up
logging itself (then its handlers decide). Silence it with
``logging.getLogger("llmserve").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator

logger = logging.getLogger("llmserve")


def _ensure_handler() -> None:
    """A stderr handler at INFO when nobody configured one (absl, pytest or the user may)."""
    if logger.handlers or logging.getLogger().handlers:
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[llmserve] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


@contextlib.contextmanager
def phase(what: str) -> Iterator[dict]:
    """Logs ``what ...`` on entry and ``what: done in X.X s`` on exit.

    The yielded dict may receive a ``detail`` string, appended to the closing line.
    """
    _ensure_handler()
    # jax logs "Unable to initialize backend 'tpu'" at INFO while probing platforms; it is
    # harmless and looks like a failure, so that one logger is raised to WARNING.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    info: dict = {}
    logger.info("%s ...", what)
    t0 = time.perf_counter()
    yield info
    detail = f" ({info['detail']})" if info.get("detail") else ""
    logger.info("%s: done in %.1f s%s", what, time.perf_counter() - t0, detail)
