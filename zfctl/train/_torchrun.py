"""torchrun as the ``--nproc`` launcher runs it: torchrun's own code, minus its tracebacks.

``python -m zfctl.train._torchrun ARGS`` parses ``ARGS`` with torchrun's parser and calls its
``run``, exactly as ``python -m torch.distributed.run ARGS`` does. What differs is the ending:
torchrun turns a failed rank into a ``ChildFailedError`` traceback and a signal into a
``SignalException`` traceback, although the rank has already printed its own one-line error (or
its stop message and checkpoint). Here both end as the ranks' exit code (the first rank to fail,
a signal's as 128 + its number), so the launcher can exit with it.
"""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str]) -> int:
    """Run torchrun on ``argv``; return the workers' exit code."""
    if "LOGLEVEL" not in os.environ:  # torchrun's own knob: a user who sets it sees everything
        # torchrun logs "Sending process P closing signal SIGTERM" and "failed (exitcode: 143)"
        # for every stop; the ranks already said what happened, in one line each.
        # Each of its modules set its logger's level at import (all imported above by now).
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        code = 128 - code if code < 0 else code  # -15 (killed by SIGTERM) -> 143, like a shell
        if code not in (1, 2, 130, 143):  # those ranks printed their own line or traceback
            print(f"error: rank {rank} exited with code {code}", file=sys.stderr)
        return code
    except SignalException as e:  # the launcher signalled torchrun before the ranks existed
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
