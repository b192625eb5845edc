"""The live proxy's cost: added latency against going direct to a worker, and its request-rate ceiling.

Prints p50/p99 of (a) non-streamed 1-token completions and (b) streamed 16-token completions, direct to a
real vLLM worker and through the controller (sent alternately, sequentially, so both see the same worker
state), the same against an instant fake upstream (the proxy's own cost, without a real worker competing
for the cores), the controller's CPU time per proxied request (from /proc, which the machine's load moves
far less than latency), and the proxy's ceiling in requests/s against the fake upstream at a fixed client
concurrency. Target: p50 added <= 2 ms. `--runs` repeats the paired measurements; the medians over runs
come last. The load average is printed before and after: on a shared machine the figures move with it.
Run in the vLLM venv:

    .venv-vllm/bin/python benchmarks/bench_proxy.py [--worker-url URL] [--n 300] [--runs 3] [--seconds 5]

Without --worker-url it starts one tiny-model worker (tests_vllm/live_workers.py). Figures depend on the
machine and on what else runs on it: this prints them, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests_vllm"))
sys.path.insert(0, str(ROOT))

FAKE = textwrap.dedent("""
    import sys
    from aiohttp import web
    BODY = b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}],"usage":{"completion_tokens":1}}'
    async def models(r): return web.json_response({"data": [{"id": "tiny", "max_model_len": 512}]})
    async def metrics(r): return web.Response(text='vllm:num_requests_running{engine="0"} 0\\n')
    async def comp(r):
        await r.read()
        return web.Response(body=BODY, content_type="application/json")
    app = web.Application()
    app.router.add_get("/v1/models", models); app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", comp)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
""")


def free_port() -> int:
    from live.vllm_server import free_port as fp  # (it moved from tests_vllm/live_workers.py)

    return fp()


def start_controller(worker_url: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    import yaml

    port = free_port()
    cfg = {"server": {"port": port}, "workers": [{"id": "w0", "url": worker_url}],
           "router": {"name": "least-outstanding", "scrape_interval_s": 0.5}, "health": {"interval_s": 60}}
    p = tmp / f"live-{port}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "live", str(p), "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait(url + "/health", proc)
    return proc, url


def wait(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"error: {url} did not come up")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; the scrape and health loops included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def paired(direct: str, proxied: str, n: int, stream: bool) -> tuple[np.ndarray, np.ndarray]:
    import aiohttp

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 16 if stream else 1, "ignore_eos": True,
            "stream": stream}
    out = {direct: [], proxied: []}
    async with aiohttp.ClientSession() as c:
        for i in range(n + 20):
            for base in ((direct, proxied) if i % 2 else (proxied, direct)):
                t0 = time.perf_counter()
                async with c.post(base + "/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200, await r.text()
                if i >= 20:  # warm-up
                    out[base].append(time.perf_counter() - t0)
    return np.array(out[direct]), np.array(out[proxied])


async def ceiling(url: str, seconds: float, conc: int) -> float:
    import aiohttp

    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    done = 0
    stop = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as c:
        async def loop():
            nonlocal done
            while time.perf_counter() < stop:
                async with c.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    done += r.status == 200
        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(conc)))
        return done / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker-url")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="repeats of the paired measurements")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    procs = []
    worker = None
    try:
        url = args.worker_url
        if url is None:
            from live_workers import build_model, start_worker, wait_ready

            worker = start_worker("bench", build_model(), "0", tempfile.mkdtemp(), tmp)
            print("starting a tiny vLLM worker ...", flush=True)
            wait_ready(worker)
            url = worker.url
        proc, proxied = start_controller(url, tmp)
        procs.append(proc)
        fport = free_port()
        fake = subprocess.Popen([sys.executable, "-c", FAKE, str(fport)], start_new_session=True)
        procs.append(fake)
        furl = f"http://127.0.0.1:{fport}"
        wait(furl + "/v1/models", fake)
        fproc, fproxied = start_controller(furl, tmp)
        procs.append(fproc)
        cases = [("vLLM worker", "1 token, not streamed", url, proxied, proc, False),
                 ("vLLM worker", "16 tokens, streamed", url, proxied, proc, True),
                 ("instant fake", "1 token, not streamed", furl, fproxied, fproc, False)]
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
        print(f"{'run':<4}{'upstream':<14}{'requests':<23}{'direct p50':>11}{'proxy p50':>11}{'added p50':>11}"
              f"{'direct p99':>11}{'proxy p99':>11}{'added p99':>11}{'proxy CPU':>11}")
        added: dict[tuple[str, str], list[float]] = {}
        cpus: dict[tuple[str, str], list[float]] = {}
        q = lambda a, x: 1e3 * float(np.percentile(a, x))  # noqa: E731
        for run in range(1, args.runs + 1):
            for up, label, direct, through, ctl_proc, stream in cases:
                c0 = cpu_s(ctl_proc.pid)
                d, p = asyncio.run(paired(direct, through, args.n, stream))
                per = 1e6 * (cpu_s(ctl_proc.pid) - c0) / (args.n + 20)
                added.setdefault((up, label), []).append(q(p, 50) - q(d, 50))
                cpus.setdefault((up, label), []).append(per)
                print(f"{run:<4}{up:<14}{label:<23}{q(d, 50):>9.2f}ms{q(p, 50):>9.2f}ms{q(p, 50) - q(d, 50):>9.2f}ms"
                      f"{q(d, 99):>9.2f}ms{q(p, 99):>9.2f}ms{q(p, 99) - q(d, 99):>9.2f}ms{per:>9.0f}us", flush=True)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for key, xs in added.items():
            print(f"median over {len(xs)} runs, {key[0]}, {key[1]}: p50 added {float(np.median(xs)):.2f} ms "
                  f"(runs: {', '.join(f'{x:.2f}' for x in xs)}); controller CPU {float(np.median(cpus[key])):.0f} "
                  "us per request")
        direct_rate = asyncio.run(ceiling(furl, args.seconds, args.concurrency))
        proxy_rate = asyncio.run(ceiling(fproxied, args.seconds, args.concurrency))
        print(f"ceiling, instant fake upstream, {args.concurrency} concurrent: direct {direct_rate:,.0f} req/s, "
              f"through the proxy {proxy_rate:,.0f} req/s ({os.cpu_count()} cores shared by client, proxy and "
              "upstream)")
    finally:
        from live.vllm_server import stop_group

        for p in procs:
            stop_group(p, 5)
        if worker is not None:
            worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
