"""The same scenario gives the same results in every process: nothing a run decides may follow Python's salted
str hash (PYTHONHASHSEED), e.g. the order of a set of instance ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from twin.policy import ApproxPrefixIndex, CacheAware
from twin.policy.base import ROUTERS

from policy_fakes import fleet_of, req

ROOT = Path(__file__).resolve().parents[1]

# Each router on a prefix-heavy trace with hashes (Mooncake) and on prompt texts over shared documents, without
# hashes (the prefixes then come from the texts); a digest of where each request went and when it finished.
SCRIPT = """
import hashlib, sys
import numpy as np
from twin.scenario import load_scenario
from twin.sim.cluster import Cluster
from twin.workload import build_stream
root = sys.argv[1]
for router in sys.argv[2:]:
    for path, over, texts in [("mooncake-replay.yaml", ["workload.trace.max_requests=300"], False),
                              ("quickstart.yaml", ["workload.num_requests=300", "cluster.num_instances=3"], True)]:
        sc = load_scenario(f"{root}/scenarios/{path}", over + [f"router.name={router}"])
        stream = build_stream(sc)
        if texts:
            rng = np.random.default_rng(0)
            docs = ["".join(chr(97 + x) for x in rng.integers(0, 26, 4000)) for _ in range(3)]
            stream.texts = [docs[i % 3][:4 * int(p)] + f" {i}" for i, p in enumerate(stream.prompt_tokens)]
            stream.hash_ids = None
        log = Cluster(sc, stream).run().log
        print(router, path, hashlib.sha1(log.instance.tobytes() + log.finish_s.tobytes()).hexdigest())
"""


def _digests(hash_seed: str, routers: list[str], tmp: Path) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), *routers], env=env, cwd=tmp,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_every_router_decides_the_same_under_another_str_hash_seed(tmp_path):
    routers = sorted(ROUTERS)
    a = _digests("1", routers, tmp_path)
    b = _digests("2", routers, tmp_path)
    assert len(a.splitlines()) == 2 * len(routers)
    assert a == b


class _Ordered(ApproxPrefixIndex):
    """An index whose match answers with the same counts in a chosen dict order (as set order would vary)."""

    def __init__(self, answer: dict[str, int]) -> None:
        super().__init__()
        self.answer = answer

    def match(self, prefix, instance_ids):
        return dict(self.answer)


def test_cache_aware_ties_are_drawn_in_fleet_order_whatever_the_index_order():
    picks = []
    for answer in ({"a": 3, "b": 3, "c": 1}, {"b": 3, "c": 1, "a": 3}):
        fleet = fleet_of({"id": "a"}, {"id": "b"}, {"id": "c"}, index=_Ordered(answer))
        r = CacheAware(seed=5)
        picks.append([r.choose(req(k, prompt=64, prefix=(1, 2, 3)), fleet) for k in range(40)])
    assert picks[0] == picks[1]
    assert set(picks[0]) == {"a", "b"}  # both tied holders are drawn, never the one with the shorter match
