"""Files that other processes may read or write at the same time: written whole, or not at all.

A temp file with a name of its own beside the target, renamed over it: a reader sees the old file or the
new one, never half of one, and two writers never write into the same temp file (a fixed `.tmp` name made
them tear each other's).
"""
from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_TEMP = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}\.tmp")


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A fresh path beside `path` to write to; renamed over `path` when the block succeeds, removed when it
    fails. Created with the mode a plain open() gives (mkstemp's would be 0600)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # matches _TEMP
    tmp.open("x").close()  # exclusive: the name is this writer's alone
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def replaced_name(name: str) -> str | None:
    """The name of the file that a temp file of `replacing` named `name` was to replace, else None. A writer
    killed outright (SIGKILL, power loss) leaves its temp file behind."""
    match = _TEMP.fullmatch(name)
    return match["name"] if match else None
