"""Spec data (GPUs, models) shipped as YAML so that adding one is adding an entry.

Users bring their own GPUs and models in spec files of the same shape, one YAML file with a `hardware:`
and/or a `models:` mapping, named by `twin --specs FILE` or the `LLMTWIN_SPECS` environment variable (paths
separated by the OS path separator). They are merged over the built-ins, later files over earlier ones: a new
entry must carry every required field; an entry whose name (or alias) is already known is merged field by
field, so a user can correct one figure (say `device_memory_gib`) without restating the rest.
"""

from __future__ import annotations

import functools
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from twin.errors import TwinInputError

ENV_VAR = "LLMTWIN_SPECS"
# the user file's section for each built-in spec file
SECTIONS = {"hardware.yaml": "hardware", "models.yaml": "models"}
REQUIRED = {
    "hardware.yaml": ("peak_flops", "hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth"),
    "models.yaml": ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "num_params", "max_model_len"),
}
BUILT_IN = "built-in"

_cli_files: tuple[str, ...] = ()


def use_files(paths: list[str] | tuple[str, ...]) -> None:
    """Spec files named on the command line (`twin --specs`); also exported to child processes via the env var."""
    global _cli_files
    _cli_files = tuple(str(p) for p in paths)
    if _cli_files:
        os.environ[ENV_VAR] = os.pathsep.join(_cli_files)


def user_files() -> tuple[str, ...]:
    """The user spec files in force: the command line's, else the environment's."""
    if _cli_files:
        return _cli_files
    env = os.environ.get(ENV_VAR, "")
    return tuple(p for p in env.split(os.pathsep) if p.strip())


def load(name: str) -> dict:
    """The spec table `name` ('hardware.yaml' or 'models.yaml'): built-ins merged with the user's files."""
    return _merged(name, user_files())[0]


def origin(name: str, key: str) -> str:
    """Where entry `key` of table `name` comes from: 'built-in', a user file's path, or 'built-in + FILE'."""
    return _merged(name, user_files())[1].get(key, BUILT_IN)


def spec_file_of(name: str, key: str) -> str:
    """The file to name in an error about entry `key`: the last user file that touched it, else the built-in."""
    o = origin(name, key)
    if o == BUILT_IN:
        return str(Path(__file__).with_name(name))
    return o.rsplit(" + ", 1)[-1]


@lru_cache(maxsize=None)
def _builtin(name: str) -> dict:
    text = resources.files(__package__).joinpath(name).read_text()
    return yaml.safe_load(text)


@lru_cache(maxsize=32)
def _merged(name: str, files: tuple[str, ...]) -> tuple[dict, dict]:

    table = {k: dict(v) for k, v in _builtin(name).items()}
    where: dict[str, str] = {}
    section = SECTIONS[name]
    known_fields = {field for e in _builtin(name).values() for field in e} | set(REQUIRED[name])
    for f in files:
        for key, entry in _read_user_file(f).get(section, {}).items():
            unknown = sorted(set(entry) - known_fields)
            if unknown:  # a misspelt or foreign name (config.json's num_attention_heads) would be ignored
                raise TwinInputError(f"{f}: {section} entry {key!r}: unknown field {unknown[0]!r} "
                                     f"(known: {', '.join(sorted(known_fields))})")
            found = resolve(table, key)
            if found is not None:  # a correction of a known entry: field by field
                known, old = found
                table[known] = {**old, **entry}
                where[known] = f"{where.get(known, BUILT_IN)} + {f}"
                _check_names(table, known, f, section, key)
                continue
            missing = [field for field in REQUIRED[name] if field not in entry]
            if missing:
                raise TwinInputError(f"{f}: {section} entry {key!r}: missing field {missing[0]!r} "
                                     f"(a new entry needs: {', '.join(REQUIRED[name])})")
            table[key] = dict(entry)
            where[key] = f
            _check_names(table, key, f, section, key)
    return table, where


def _check_names(table: dict, key: str, path: str, section: str, given: str) -> None:
    """Entry `key`'s aliases name no other entry: one that did took that entry's name over (H200 read as H100)."""
    aliases = table[key].get("aliases", [])
    if not isinstance(aliases, list):
        return  # the entry's own check names a bad value
    for a in aliases:
        for other, entry in table.items():
            if other != key and (str(a).lower() == other.lower()
                                 or str(a).lower() in (str(x).lower() for x in entry.get("aliases", []) or [])):
                raise TwinInputError(f"{path}: {section} entry {given!r}: alias {a!r} already names entry {other!r}")


@lru_cache(maxsize=32)
def _read_user_file(path: str) -> dict:
    """One user spec file, checked for shape; every problem is one line naming the file."""

    p = Path(path)
    if not p.is_file():
        raise TwinInputError(f"spec file {path}: no such file" + (" (it is a directory)" if p.is_dir() else ""))
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise TwinInputError(f"spec file {path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise TwinInputError(f"spec file {path}: not valid YAML{at}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TwinInputError(f"spec file {path}: expected a mapping with 'hardware:' and/or 'models:'")
    unknown = sorted(set(map(str, data)) - set(SECTIONS.values()))
    if unknown:
        raise TwinInputError(f"spec file {path}: unknown section {unknown[0]!r} (expected: hardware, models)")
    for section, entries in data.items():
        if not isinstance(entries, dict):
            raise TwinInputError(f"spec file {path}: '{section}' must map entry names to their fields")
        for key, entry in entries.items():
            if not isinstance(entry, dict):
                raise TwinInputError(f"spec file {path}: {section} entry {key!r} must be a mapping of fields")
    return {s: {str(k): v for k, v in e.items()} for s, e in data.items()}


def resolve(table: dict, name: str) -> tuple[str, dict] | None:
    """Find an entry by its key or one of its aliases, case-insensitively."""
    want = name.lower()
    for key, entry in table.items():
        if key.lower() == want or want in (a.lower() for a in entry.get("aliases", [])):
            return key, entry
    return None


def spec_entry_errors(spec_file: str):
    """Decorate a spec lookup `get_x(name)` so an entry missing a field (KeyError) or holding a value of the
    wrong type is a TwinInputError naming the spec file, the entry and the field, not a traceback."""

    def wrap(lookup):
        @functools.wraps(lookup)
        def checked(name, *args, **kwargs):
            try:
                return lookup(name, *args, **kwargs)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                if isinstance(e, TwinInputError):
                    raise
                found = resolve(load(spec_file), name)
                entry = f"entry {found[0] if found else name!r}"
                where = spec_file_of(spec_file, found[0]) if found else Path(__file__).with_name(spec_file)
                if isinstance(e, KeyError):
                    raise TwinInputError(f"{where}: {entry}: missing field {e.args[0]!r}") from None
                raise TwinInputError(f"{where}: {entry}: a field has a bad value ({e})") from None

        return checked

    return wrap
