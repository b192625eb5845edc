"""`--start` (start_s) means the same in every trace format: seconds after the trace's first request."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from twin.errors import TwinInputError
from twin.workload.formats import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
OFFSET = 1000.0  # the first request's time on the file's own clock
GAPS = [0.0, 10.0, 20.0, 30.0, 40.0]  # the requests, in seconds after the first


def timed_files(tmp_path) -> dict[str, Path]:
    """The same five requests in each timed format, the first at OFFSET s on the file's clock."""
    az = tmp_path / "az.csv"
    day = datetime(2023, 11, 16)
    az.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{day + timedelta(seconds=OFFSET + g):%Y-%m-%d %H:%M:%S}.0000000,100,10\n" for g in GAPS))
    bg = tmp_path / "bg.csv"
    bg.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{OFFSET + g:g},ChatGPT,100,10,110,Conversation log\n" for g in GAPS))
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"timestamp": (OFFSET + g) * 1000, "input_length": 100, "output_length": 10,
                                      "hash_ids": [i]}) + "\n" for i, g in enumerate(GAPS)))
    return {"azure": az, "burstgpt": bg, "mooncake": mc}


@pytest.mark.parametrize("fmt", ["azure", "burstgpt", "mooncake"])
def test_start_counts_from_the_first_request_in_every_timed_format(tmp_path, fmt):
    path = timed_files(tmp_path)[fmt]
    whole = load_trace(path, fmt)
    np.testing.assert_allclose(whole.arrival_s, GAPS)
    assert whole.stats.span_s == pytest.approx(40.0)
    s = load_trace(path, fmt, start_s=15.0)  # the requests at 20, 30, 40 s after the first
    np.testing.assert_allclose(s.arrival_s, [5.0, 15.0, 25.0])
    s = load_trace(path, fmt, start_s=15.0, duration_s=10.0)
    np.testing.assert_allclose(s.arrival_s, [5.0])


@pytest.mark.parametrize("fmt", ["sharegpt", "lengths"])
def test_untimed_traces_start_at_their_first_drawn_arrival(fmt):
    path = TRACES / ("sharegpt.sample.json" if fmt == "sharegpt" else "sharegpt_lengths.sample.csv")
    whole = load_trace(path, fmt, rate=5.0, seed=3, max_requests=200)
    assert whole.arrival_s[0] == 0.0
    later = load_trace(path, fmt, rate=5.0, seed=3, max_requests=200, start_s=10.0)
    kept = whole.arrival_s[whole.arrival_s >= 10.0] - 10.0
    np.testing.assert_allclose(later.arrival_s, kept)


def test_servegen_start_counts_from_the_first_active_window():
    # client 28's windows are idle (rate 0) until window_start_s 49800: --start 0 now means that window
    s = load_trace(TRACES / "servegen_m-large", start_s=0, duration_s=600, seed=1)
    assert len(s) > 0 and s.arrival_s.min() >= 0 and s.arrival_s.max() < 600
    assert any("window_start_s 49800" in n for n in s.stats.notes)


def test_an_empty_window_says_the_traces_span(tmp_path):
    path = timed_files(tmp_path)["mooncake"]
    with pytest.raises(TwinInputError) as e:
        from twin.scenario import parse_scenario
        from twin.workload import build_stream

        sc = parse_scenario({"cluster": {"num_instances": 1},
                             "workload": {"trace": {"path": str(path), "start_s": 100}}})
        build_stream(sc)
    msg = str(e.value)
    assert "no requests left" in msg and "starting 100 s after the first request" in msg
    assert "span 40 s from its first request" in msg
    with pytest.raises(TwinInputError, match="idle in the window 10,000,000 s to 10,000,060 s .* span 1,130,400 s"):
        load_trace(TRACES / "servegen_m-large", start_s=1e7, duration_s=60)
