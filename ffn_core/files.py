"""What a path that is not a regular file is, in words: the one table, no torch.

Weights and config files are read only when they are regular files (a FIFO would block the start,
/dev/zero never end); whoever refuses one names what it is with `file_kind`: the weight readers
(ffn_core/readers.py), the settings' config file and the command's checks before torch (app/).
"""

from __future__ import annotations

import stat

# Checked in this order.
_FILE_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its `st_mode`: 'a directory', 'a FIFO (named pipe)', ..."""
    return next((name for is_type, name in _FILE_TYPES if is_type(mode)), "a special file")
