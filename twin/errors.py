"""One exception type for bad user input, so the CLI can print one clear line instead of a traceback."""

from __future__ import annotations

from pathlib import Path


class TwinInputError(ValueError):
    """A user-facing input problem: a bad scenario field, trace row, model or GPU name."""


def out_folder(out: Path, flag: str = "--out") -> Path:
    """`out` made (with its parents) before any work, or one clear line: a file of that name, a path under a file,
    no permission (a long run used to end in a traceback when it came to write)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TwinInputError(f"{flag} {out}: cannot make the folder: {e.strerror or e}") from None
    return out
