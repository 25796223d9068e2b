"""What the subcommands share: checks of user input made before any work starts (output paths,
seeds), the one-line error every subcommand reports, and the quieting of optional libraries'
import-time noise."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path

__all__ = ["UsageError", "SEED_MAX", "seed_arg", "check_seed", "check_output_file", "check_output_dir",
           "one_line", "quiet_optional_imports"]

#: torch.Generator.manual_seed takes seeds that fit in 64 bits; negative ones alias 2**64 + seed,
#: so two different seeds would give the same video: the accepted range is 0 .. 2**64 - 1.
SEED_MAX = 2**64 - 1


class UsageError(ValueError):
    """Input the command cannot use: reported as one line ``fp4video <command>: error: ...``, exit 2."""


def check_seed(seed, what: str = "seed") -> int:
    """``seed`` when it is an integer in 0 .. 2**64 - 1, else a :class:`UsageError` naming ``what``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"{what} {seed!r}: not an integer")
    if not 0 <= seed <= SEED_MAX:
        raise UsageError(f"{what} {seed}: out of range; seeds are integers from 0 to 2**64 - 1 = {SEED_MAX} "
                         "(what torch's random generator accepts)")
    return seed


def seed_arg(text: str) -> int:
    """argparse ``type=`` for seeds: an integer in 0 .. 2**64 - 1 (argparse reports the rest)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text}: out of range; seeds are integers from 0 to 2**64 - 1 = {SEED_MAX}")
    return value


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe_writable(folder: Path, flag: str, path: Path) -> None:
    """Create and remove a file in ``folder``: the one test of writability that holds for every
    user, file system and mount option (permission bits alone say nothing for root or read-only mounts)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".fp4video-write-test-")
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {folder} ({e.strerror or type(e).__name__})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def _check_parent(path: Path, flag: str) -> None:
    """The folder ``path`` goes in exists (or can be created) and takes new files."""
    parent = path.parent if str(path.parent) else Path(".")
    base = _nearest_existing(parent)
    if not base.is_dir():
        raise UsageError(f"{flag} {path}: {base} is a file, not a folder")
    _probe_writable(base, flag, path)


def check_output_file(path: Path | str, flag: str, suffixes: tuple[str, ...] | None = None,
                      companions: tuple[str, ...] = ()) -> Path:
    """``path`` as a file the command can write at the end: not a folder, ending in one of
    ``suffixes`` (case-insensitive; None: any), in a folder that exists or can be created and takes
    new files; ``companions`` are suffixes of files written beside it (``.json``: a sidecar), which
    must not be folders either. A :class:`UsageError` naming ``flag`` otherwise."""
    path = Path(path)
    if str(path) in ("", "."):
        raise UsageError(f"{flag}: empty file name")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name"
                         + (f" ending in {' or '.join(suffixes)}" if suffixes else ""))
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise UsageError(f"{flag} {path}: the file is written as {' or '.join(s.lstrip('.') for s in suffixes)}; "
                         f"give a name ending in {' or '.join(suffixes)}"
                         + (f" (not {path.suffix!r})" if path.suffix else ""))
    for suffix in companions:
        other = path.with_suffix(suffix)
        if other.is_dir():
            raise UsageError(f"{flag} {path}: {other} (written beside it) is a folder")
    _check_parent(path, flag)
    return path


def check_output_dir(path: Path | str, flag: str) -> Path:
    """``path`` as a folder the command can write into: an existing folder, or one that can be
    created (its nearest existing ancestor is a folder that takes new files)."""
    path = Path(path)
    if str(path) == "":
        raise UsageError(f"{flag}: empty folder name")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a folder")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UsageError(f"{flag} {path}: {base} is a file, not a folder")
    _probe_writable(base, flag, path)
    return path


#: The parts of pydantic's own text for a ValidationError (``str(err)``, also inside another message):
#: a header ``N validation error(s) for Model``, then for each error its location on a line and the
#: reason on the next, indented and ending in ``[type=..., input_value=..., input_type=...]``, then a
#: line ``For further information visit <url>``.
_PYDANTIC_HEADER = re.compile(r"\d+ validation errors? for [\w.\[\], ]+$")
_PYDANTIC_URL = re.compile(r"For further information visit \S+")
_PYDANTIC_DETAILS = re.compile(r"\s*\[type=[^,\]]+(?:, input_value=(?P<value>.*), input_type=[^\]]+)?\]$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _pydantic_reason(text: str) -> str:
    """pydantic's reason line without its details bracket (the value it got kept, when short and scalar)."""
    m = _PYDANTIC_DETAILS.search(text)
    reason = text[: m.start()] if m else text
    reason = reason.strip().removeprefix("Value error, ")
    value = m.group("value") if m else None
    if value is not None and value[:1] not in "{[(" and len(value) <= 60:
        reason += f" (got {value})"
    return reason


def one_line(message: str) -> str:
    """A message on one line: several problems joined by "; ". pydantic's own text for a validation
    error, where a message carries it, becomes ``location: reason`` per error, its header and its
    links to pydantic's documentation left out: the reason is kept, whatever line a caller printed."""
    lines = [line.rstrip() for line in str(message).splitlines() if line.strip()]
    out: list[str] = []
    i = 0
    while i < len(lines):
        line, text = lines[i], lines[i].strip()
        i += 1
        if _PYDANTIC_URL.fullmatch(text):
            continue
        head = _PYDANTIC_HEADER.search(text)
        if head and i < len(lines):  # the errors follow: they say it (a header alone is all there is)
            text = text[: head.start()].strip()
        if i < len(lines) and _indent(lines[i]) > _indent(line) and _PYDANTIC_DETAILS.search(lines[i]):
            reason = _pydantic_reason(lines[i])
            text = f"{text}{' ' if text.endswith(':') else ': '}{reason}" if text else reason
            i += 1
        elif _PYDANTIC_DETAILS.search(text):
            text = _pydantic_reason(text)
        if not text:
            continue
        if out and out[-1].endswith(":"):
            out[-1] += " " + text
        else:
            out.append(text)
    return "; ".join(out)


class _DropMessages(logging.Filter):
    """Drops records whose message contains one of ``needles``; every other record passes."""

    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a record that cannot format is not ours to judge
            return True
        return not any(n in msg for n in self.needles)


#: Import-time noise of optional libraries that are installed (e.g. with the test extras) but that
#: no fp4video command uses: transformers' and diffusers' quantizer registries import torchao when it
#: is installed, and torchao then logs compiled extensions it cannot load on this torch and
#: deprecated pytree registrations. (logger name, message fragments) pairs; only these records are
#: dropped, so every other warning, from these loggers too, still shows.
OPTIONAL_IMPORT_NOISE = (
    ("torchao", ("Failed to load ", "Skipping import of cpp extensions")),
    ("torch.utils._pytree", ("is an Enum subclass and is now natively supported",)),
    ("diffusers.quantizers.torchao.torchao_quantizer", ("Unable to import `torchao` Tensor objects",)),
)


@contextlib.contextmanager
def quiet_optional_imports():
    """Within the block, the records of :data:`OPTIONAL_IMPORT_NOISE` are dropped; the filters go
    on the way out (a caller of ``main`` in the same process keeps its logging as it was)."""
    installed = []
    for name, needles in OPTIONAL_IMPORT_NOISE:
        f = _DropMessages(needles)
        logger = logging.getLogger(name)
        logger.addFilter(f)
        installed.append((logger, f))
    try:
        yield
    finally:
        for logger, f in installed:
            logger.removeFilter(f)
