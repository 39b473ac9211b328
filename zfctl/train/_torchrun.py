"""torchrun as the ``--nproc`` launcher runs it: torchrun's own code, minus its tracebacks.

``python -m zfctl.train._torchrun ARGS`` parses ``ARGS`` with torchrun's parser and calls its
``run``, exactly as ``python -m torch.distributed.run ARGS`` does. What differs is the ending:
torchrun turns a failed rank into a ``ChildFailedError`` traceback and a signal into a
``SignalException`` traceback, although the rank has already printed its own one-line error (or
its stop message and checkpoint). Here both end as the ranks' exit code (the first rank to fail,
a signal's as 128 + its number; a rank that died without a word, e.g. SIGKILLed, is named, with
the resume command for the run folder, and its code preferred), so the launcher can exit with it.
Under the ``--nproc`` launcher it also dies with the launcher and has its ranks die with it
(zfctl.train.dist, ``bind_to_launcher``).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from zfctl.train.dist import PARENT_ENV, RUN_DIR_ENV, TIMEOUT_EXIT, bind_to_launcher, continue_hint


def main(argv: list[str]) -> int:
    """Run torchrun on ``argv``; return the workers' exit code."""
    bind_to_launcher()  # a SIGKILLed launcher takes torchrun with it...
    os.environ[PARENT_ENV] = str(os.getpid())  # ...and torchrun its ranks (they call it too)
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
        # -15 (killed by SIGTERM) -> 143, like a shell
        codes = {r: 128 - f.exitcode if f.exitcode < 0 else f.exitcode for r, f in sorted(e.failures.items())}
        if TIMEOUT_EXIT in codes.values():
            # A rank waited distributed.timeout and named the ranks that hung; torchrun's shutdown
            # then SIGKILLed those (137): already said, in that one line.
            return TIMEOUT_EXIT
        # Ranks ending 1/2/130/143 printed their own line (or a bug's traceback); any other code
        # (a SIGKILL, the OOM killer, a segfault) is named here, since that rank could not.
        # Every such rank, not just the "first" failure: torchrun's timestamps have 1 s
        # resolution, so a killed rank and a peer that stopped because of it can tie.
        silent = {r: c for r, c in codes.items() if c not in (1, 2, 130, 143)}
        run_dir = os.environ.get(RUN_DIR_ENV)  # read now: the newest checkpoint the job left
        hint = f"; {continue_hint(Path(run_dir))}" if run_dir and silent else ""
        for r, c in silent.items():
            print(f"error: rank {r} exited with code {c}{hint}", file=sys.stderr)
        return next(iter(silent.values())) if silent else codes[e.get_first_failure()[0]]
    except SignalException as e:  # the launcher signalled torchrun before the ranks existed
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
