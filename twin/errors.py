"""One exception type for bad user input, so the CLI can print one clear line instead of a traceback."""

from __future__ import annotations

import functools
from pathlib import Path


class TwinInputError(ValueError):
    """A user-facing input problem: a bad scenario field, trace row, model or GPU name."""


def spec_entry_errors(spec_file: str):
    """Decorate a spec lookup `get_x(name)` so an entry missing a field (KeyError) or holding a value of the
    wrong type is a TwinInputError naming the spec file, the entry and the field, not a traceback."""

    def wrap(lookup):
        @functools.wraps(lookup)
        def checked(name, *args, **kwargs):
            from twin import specs

            try:
                return lookup(name, *args, **kwargs)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                if isinstance(e, TwinInputError):
                    raise
                found = specs.resolve(specs.load(spec_file), name)
                entry = f"entry {found[0] if found else name!r}"
                where = specs.spec_file_of(spec_file, found[0]) if found else Path(specs.__file__).with_name(spec_file)
                if isinstance(e, KeyError):
                    raise TwinInputError(f"{where}: {entry}: missing field {e.args[0]!r}") from None
                raise TwinInputError(f"{where}: {entry}: a field has a bad value ({e})") from None

        return checked

    return wrap
