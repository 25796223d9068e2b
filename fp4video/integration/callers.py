"""Where a warning raised inside a model's call points: the user's line that called the model, not
torch's ``module.py`` that calls fp4video's hooks and forwards."""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["caller_stacklevel"]


def _package_dirs(*names: str) -> tuple[str, ...]:
    """The folders of the installed packages ``names`` (found, not imported: diffusers loads lazily)."""
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        dirs += [os.path.abspath(d) + os.sep for d in (spec.submodule_search_locations or [])] if spec else []
    return tuple(dirs)


#: folders whose frames a warning raised inside a model's call skips: it names the user's line
_LIBRARY_DIRS = _package_dirs("torch", "diffusers")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside torch, diffusers and fp4video (the user's
    ``pipe(...)`` or ``model(...)`` line) for a warning raised by the function calling this one
    from inside a model's call; 2 when every frame is theirs."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_LIBRARY_DIRS + (_PACKAGE_DIR,)):
            return level
        frame, level = frame.f_back, level + 1
    return 2
