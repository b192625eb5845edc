"""A module of another git revision, loaded beside this tree's for the A/B benchmarks (ab_router, ab_block)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_rev(rev: str, path: str, name: str, tmp: Path, replace: dict | None = None):
    """A module of the revision, loaded under another name; `replace` maps module names it imports to stand-ins."""
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                             text=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{Path(sys.argv[0]).stem}: cannot read {path} at {rev!r}: {e.stderr.strip()}") from None
    f = tmp / f"{name}.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location(name, f)
    mod = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules.get(k) for k in (replace or {})}
    sys.modules.update(replace or {})
    try:
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod
