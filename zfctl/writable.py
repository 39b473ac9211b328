"""Write pre-flight and OS errors as one line.

Every verb that writes proves, before any work, that it can: it creates and removes a probe
file in the destination folder (or the nearest folder that exists, where the destination will
be created). Permissions, read-only mounts, ACLs and full inode tables are all covered by the
one test the kernel actually applies, instead of guessing from mode bits (which say nothing for
root, or on a read-only mount). Costs one create + unlink per command.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from zfctl.errors import UserError


def os_error_line(e: OSError) -> str:
    """``e`` as one line for the terminal: the path, what the errno means, its name."""
    name = errno.errorcode.get(e.errno or 0, "")
    what = e.strerror or os.strerror(e.errno or 0) or str(e)
    where = f"{e.filename}: " if e.filename is not None else ""
    if e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}: "
    return f"{where}{what}" + (f" ({name})" if name else "")


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (where a ``mkdir -p`` would start)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(dest: Path, flag: str, fix: str = "choose another location",
                   shown: Path | str | None = None) -> None:
    """Raise a UserError naming ``flag`` unless files can be created where ``dest`` goes.

    ``dest`` is a folder to write into (it may not exist yet: its nearest existing ancestor is
    probed, as that is where the folders will be created). ``shown``: the value the user typed,
    when it is a file inside ``dest``.
    """
    folder = nearest_existing(Path(dest))
    named = shown if shown is not None else dest  # the path as the user typed it
    if not folder.is_dir():
        raise UserError(f"{flag} {named}: {folder} is a file, not a folder; {fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zfctl-probe-", dir=folder)
    except OSError as e:
        e.filename, e.filename2 = str(folder), None  # the folder, not the random probe name
        raise UserError(f"{flag} {named}: cannot create files in {os_error_line(e)}; {fix}") from None
    os.close(fd)
    os.unlink(probe)


def current_umask() -> int:
    """The process umask, for files made with another mode than the usual 0666 - umask
    (``tempfile.mkstemp``, safetensors: 0600). Reading it means setting it: set back at once."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
