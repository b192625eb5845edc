"""The machine line every benchmark and observation prints with its figures."""

import os

from twin.lab.machine import describe, machine


def test_machine_names_cpu_cores_memory_and_load():
    m = machine()
    assert m["cpu"] and m["cores"] == os.cpu_count() and 1 <= m["usable_cores"] <= m["cores"]
    assert m["mem_gib"] is None or m["mem_gib"] > 0
    assert len(m["loadavg"]) == 3
    line = describe(m)
    assert m["cpu"] in line and f"{m['cores']} CPUs" in line and "load average" in line
