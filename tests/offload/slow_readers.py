"""Late host readers, for the tests of the waits that guard a buffer against its *next writer*.

Slowing the copies (tests/gpu, ``pcie.delay_copies``) shows a reader that does not wait for a
copy. The other kind of wait, a writer that must wait until the last reader is done (a landing
buffer reused two steps later, the one host accumulator of the device path, the master under an
install), shows only when the reader is late: ``slow_readers`` makes each accumulation job (hook
path) and each CPU update sleep before it reads, so a writer that does not wait overwrites what
the reader has not read yet, every time. Results must not change: no wait depends on timing.
"""

from __future__ import annotations

import time
from typing import Any


def slow_readers(opt: Any, *, accumulate_s: float = 0.0, update_s: float = 0.0) -> None:
    """Each accumulation job of ``opt``'s hook path sleeps ``accumulate_s`` before it reads the
    landing buffer (stream.py ``_add``); each CPU update sleeps ``update_s`` before it reads the
    accumulator and the master (worker.py ``run``)."""
    stream = getattr(opt.gradient_path, "stream", None)
    if accumulate_s and stream is not None:
        add = stream._accumulate

        def late_add(*args: Any, **kw: Any) -> None:
            time.sleep(accumulate_s)
            add(*args, **kw)

        stream._accumulate = late_add
    worker = opt.pipeline.worker
    if update_s and worker is not None:
        run = worker.run

        def late_run(update: Any) -> float:
            time.sleep(update_s)
            return run(update)

        worker.run = late_run
