"""A calibration's files written as one set: the new set in full, or the previous one untouched.

Every file goes to a temporary name in the output folder first; only when all are written are
they renamed into place (each :func:`os.replace` is atomic on one file system), the previous files
set aside until the last rename has succeeded and put back if one fails. A folder standing where a
file goes is found before anything is written."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..integration.media import temporary_sibling

__all__ = ["FileSetError", "write_file_set"]


class FileSetError(OSError):
    """A file of the set could not be written; the folder holds its previous files. One line."""


def _reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


def write_file_set(out_dir: Path, files: dict, stale: tuple = ()) -> dict:
    """Write ``files`` ({file name: bytes}) in ``out_dir`` as one set and return {name: path}.
    Files named in ``stale`` that the set does not hold are removed with the swap (an earlier set's
    files that would contradict this one). A :class:`FileSetError` naming the file that failed
    leaves the folder as it was."""
    out_dir = Path(out_dir)
    names = list(files)
    done = "the folder's previous files are as they were"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileSetError(f"{out_dir}: cannot create the folder ({_reason(e)})") from None
    for name in names:
        path = out_dir / name
        if path.is_dir():
            raise FileSetError(f"{path}: is a folder, where the calibration's {name} goes; nothing written ({done})")
    remove = [n for n in stale if n not in files and (out_dir / n).is_file()]
    with contextlib.ExitStack() as stack:
        new = {n: stack.enter_context(temporary_sibling(out_dir / n)) for n in names}
        old = {n: stack.enter_context(temporary_sibling(out_dir / n)) for n in [*names, *remove]}
        for name in names:
            try:
                new[name].write_bytes(files[name])
            except OSError as e:
                raise FileSetError(f"{out_dir / name}: cannot be written ({_reason(e)}); nothing written ({done})") \
                    from None
        set_aside, placed = [], []
        try:
            for name in old:  # the previous files step aside (removed on the way out once all are in)
                if (out_dir / name).exists() or (out_dir / name).is_symlink():
                    os.replace(out_dir / name, old[name])
                    set_aside.append(name)
            for name in names:
                os.replace(new[name], out_dir / name)
                placed.append(name)
        except OSError as e:
            failed = name
            for n in placed:
                with contextlib.suppress(OSError):
                    (out_dir / n).unlink()
            for n in set_aside:
                with contextlib.suppress(OSError):
                    os.replace(old[n], out_dir / n)
            raise FileSetError(f"{out_dir / failed}: cannot be put in place ({_reason(e)}); nothing written ({done})") \
                from None
    return {n: out_dir / n for n in names}
