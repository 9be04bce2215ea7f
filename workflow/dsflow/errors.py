"""The one exception type for user mistakes, and the one line for a write the disk refused."""

from __future__ import annotations

import errno
import re

# What the disk or file system refused, and what to do about it.
DISK_ERRORS = {
    errno.ENOSPC: "no space left on device: free space there (or move the project to a bigger disk)",
    errno.EDQUOT: "disk quota exceeded: free space within the quota (or raise it)",
    errno.EFBIG: "file too large for the file system or `ulimit -f`: raise the limit (or move the "
    "project to a file system without it)",
    errno.EIO: "input/output error: the disk or network file system failed; check it (dmesg)",
    errno.EROFS: "read-only file system: remount it read-write (or run in a writable folder)",
    errno.EACCES: "permission denied: make it writable for this user (or run where you may write)",
}

# numpy's tofile reports a short write without its errno.
SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


class UsageError(Exception):
    """A user mistake: reported as one line, exit code 2, no traceback."""


def disk_error(e: BaseException) -> str | None:
    """One line for an OSError the disk or file system raised on a path, naming the path, what
    went wrong and the fix; None for anything else (a bug keeps its traceback)."""
    if not isinstance(e, OSError) or not e.filename:
        return None
    if e.errno in DISK_ERRORS:
        return f"{e.filename}: {DISK_ERRORS[e.errno]} ({errno.errorcode[e.errno]}), then rerun"
    if e.errno is None and e.args and SHORT_WRITE.fullmatch(str(e.args[0])):
        return (
            f"{e.filename}: a write was cut short ({e.args[0]}): the disk is full, over quota "
            "or past a file size limit (`ulimit -f`); free space or raise the limit, then rerun"
        )
    return None
