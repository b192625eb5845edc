"""`llmtwin-live CONFIG` (and `twin live CONFIG`): run the controller until SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from pathlib import Path
from typing import List, Optional


def run(config: Path, overrides: Optional[List[str]] = None, host: Optional[str] = None,
        port: Optional[int] = None, log_level: str = "info") -> int:
    """Load, validate and serve; bad config is one `error:` line and exit 2, a clean stop exits 0."""
    from twin.errors import TwinInputError

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        from live.config import load_config

        sets = list(overrides or [])
        if host is not None:
            sets.append(f"server.host={host}")
        if port is not None:
            sets.append(f"server.port={port}")
        cfg = load_config(config, sets)
        from live.controller import Controller

        ctl = Controller(cfg)
    except TwinInputError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: the live controller needs the [live] extra (pip install 'llmtwin[live]'): {e}",
              file=sys.stderr)
        return 2
    from live.launcher import LaunchError
    from live.proxy import serve

    # what is loaded by now (modules, the config, the controller) lives as long as the process: frozen, the
    # collector's full passes skip it. They hold the GIL: a Block decision on the routing thread, and every stream
    # with it, waited 30-39 ms in one (10-14 ms, then 6-8, frozen: benchmarks/bench_live_block.py)
    gc.freeze()
    try:
        asyncio.run(serve(ctl))
    except LaunchError as e:
        lines = str(e).splitlines() or [type(e).__name__]
        print(f"error: {lines[0]}", file=sys.stderr)
        if lines[1:]:  # the end of the worker's log
            print("\n".join(lines[1:]), file=sys.stderr)
        return 1
    except OSError as e:  # the port is taken, the address cannot be bound
        print(f"error: cannot listen on {cfg.server.host}:{cfg.server.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def main() -> None:  # pragma: no cover - the console script
    import typer

    app = typer.Typer(add_completion=False)

    @app.command()
    def live(config: Path = typer.Argument(..., help="live controller config (YAML)"),
             set_: List[str] = typer.Option([], "--set", help="override a config value: dotted.path=value"),
             host: Optional[str] = typer.Option(None, "--host"), port: Optional[int] = typer.Option(None, "--port"),
             log_level: str = typer.Option("info", "--log-level")) -> None:
        """Route OpenAI-compatible traffic to vLLM workers with a twin router."""
        raise typer.Exit(run(config, set_, host, port, log_level))

    app()
