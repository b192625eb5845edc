"""Spec data (GPUs, models) shipped as YAML so that adding one is adding an entry."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import yaml


@lru_cache(maxsize=None)
def load(name: str) -> dict:
    """The parsed YAML spec file `name` (e.g. 'hardware.yaml')."""
    text = resources.files(__package__).joinpath(name).read_text()
    return yaml.safe_load(text)


def resolve(table: dict, name: str) -> tuple[str, dict] | None:
    """Find an entry by its key or one of its aliases, case-insensitively."""
    want = name.lower()
    for key, entry in table.items():
        if key.lower() == want or want in (a.lower() for a in entry.get("aliases", [])):
            return key, entry
    return None
