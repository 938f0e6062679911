"""Writing a file so that a reader never sees it half written."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "w", **open_kw):
    """Open a temporary file beside `path`; on a clean exit flush, fsync and rename it to `path`; on an
    exception remove it, leaving whatever was at `path` before."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **open_kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
