"""The host a measurement ran on (CPU model, cores, memory, load), so every reported figure names its machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model string as /proc/cpuinfo gives it (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    """CPU model, cores (all and usable by this process), memory GiB, load average, Python."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = [float("nan")] * 3
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable, "mem_gib": mem_gib,
            "loadavg": load, "python": f"{platform.python_version()} ({platform.python_implementation()})"}


def describe(m: dict | None = None) -> str:
    """One line for a report: 'CPU, N CPUs, load average L, Python V'."""
    m = m or machine()
    return f"{m['cpu']}, {m['cores']} CPUs, load average {m['loadavg'][0]:.1f}, Python {m['python']}"
