"""Late host readers, for the tests of the waits that guard a buffer against its *next writer*.

Slowing the copies (tests/gpu, ``pcie.delay_copies``) shows a reader that does not wait for a
copy. The other kind of wait, a writer that must wait until the last reader is done (the slots of
one set, the one host sum of the device path, the master under an install), shows only when the
reader is late: ``slow_readers`` makes each CPU update sleep before it reads, so a writer that
does not wait overwrites what the reader has not read yet, every time. Results must not change:
no wait depends on timing.
"""

from __future__ import annotations

import time
from typing import Any


def slow_readers(opt: Any, *, update_s: float = 0.0) -> None:
    """Each CPU update of ``opt`` sleeps ``update_s`` before it reads the interval's slots (or the
    device path's sum) and the master (worker.py ``run``)."""
    worker = opt.pipeline.worker
    if update_s and worker is not None:
        run = worker.run

        def late_run(update: Any) -> float:
            time.sleep(update_s)
            return run(update)

        worker.run = late_run
