"""Each trace reader on real data: the samples in traces/, and the full files in ../shared/traces when present."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from twin.workload.formats import detect_format, ideal_block_reuse, load_trace
from twin.workload.formats.azure import parse_timestamps

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
DATA = ROOT / "tests" / "data"
SHARED = ROOT.parent / "shared" / "traces"


def shared(rel: str) -> Path:
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"real trace {p} not present (the shared/traces folder is not checked out next to the repo)")
    return p


def accounted(s) -> None:
    st = s.stats
    assert st.rows_used == len(s)
    assert st.rows_read == st.rows_used + st.rows_filtered + st.rows_skipped, st.to_dict()
    assert np.all(s.prompt_tokens > 0) and np.all(s.output_tokens > 0)
    assert np.all(np.diff(s.arrival_s) >= 0)


@pytest.mark.parametrize("path, fmt", [
    (TRACES / "mooncake_conversation.sample.jsonl", "mooncake"),
    (TRACES / "azure_conv.sample.csv", "azure"),
    (TRACES / "azure_code.sample.csv", "azure"),
    (TRACES / "sharegpt.sample.json", "sharegpt"),
    (TRACES / "sharegpt_lengths.sample.csv", "lengths"),
    (TRACES / "servegen_m-large", "servegen"),
    (TRACES / "servegen_m-large" / "chunk-28-trace.csv", "servegen"),
    (DATA / "burstgpt_new.csv", "burstgpt"),
    (DATA / "burstgpt_old.csv", "burstgpt"),
    (DATA / "sharegpt_multiturn.json", "sharegpt"),
])
def test_detect_format(path, fmt):
    assert detect_format(path) == fmt


def test_mooncake_sample():
    s = load_trace(TRACES / "mooncake_conversation.sample.jsonl")
    accounted(s)
    assert len(s) == 500 and s.hash_block_size == 512 and not s.hashes_cover_output
    assert s.arrival_s[-1] == pytest.approx(165.0)
    assert all(len(h) == -(-p // 512) for h, p in zip(s.hash_ids, s.prompt_tokens))


def test_mooncake_real_ideal_reuse_matches_readme():
    s = load_trace(shared("mooncake/conversation_trace.head.jsonl"))
    accounted(s)
    assert len(s) == 7851
    r = ideal_block_reuse(s.hash_ids, s.prompt_tokens)
    assert (r.blocks_referenced, r.blocks_unique) == (194284, 126103)
    assert r.block_hit_rate == pytest.approx(0.351, abs=5e-4)  # README: 35.1%
    synth = load_trace(shared("mooncake/synthetic_trace.jsonl"))
    assert ideal_block_reuse(synth.hash_ids).block_hit_rate == pytest.approx(0.640, abs=5e-4)  # README: 64.0%


def test_ideal_block_reuse_small():
    r = ideal_block_reuse([[1, 2], [1, 2, 3], [4], [1, 5]], [1024, 1300, 100, 900], block_size=512)
    assert (r.blocks_referenced, r.blocks_unique) == (8, 5)
    assert r.block_hit_rate == pytest.approx(3 / 8)
    assert r.token_hit_rate == pytest.approx((0 + 1024 + 0 + 512) / (1024 + 1300 + 100 + 900))


def test_azure_timestamps_seven_digits():
    t = parse_timestamps(["2023-11-16 18:17:03.9799600", "2023-11-16 18:17:04.0319601", "2023-11-16 18:17:05",
                          "2023-11-16T18:17:05.5Z", "2023-11-16 19:17:05.5+01:00"])
    assert t == pytest.approx([0.97996, 1.0319601, 2.0, 2.5, 2.5], abs=1e-9)
    assert np.isnan(parse_timestamps(["yesterday", "2023-11-16 18:17:03.9799600"])[0])


def test_azure_samples_and_real():
    s = load_trace(TRACES / "azure_code.sample.csv")
    accounted(s)
    assert len(s) == 1000 and s.arrival_s[0] == 0.0
    assert s.arrival_s[1] == pytest.approx(0.052, abs=1e-9)  # 18:17:04.0319600 - 18:17:03.9799600
    conv = load_trace(shared("azure_llm_2023/AzureLLMInferenceTrace_conv.head.csv"))
    accounted(conv)
    assert len(conv) == 13927
    assert conv.arrival_s[-1] == pytest.approx(39 * 60 + 13.24, abs=0.01)  # 18:15:46.68 -> 18:54:59.92
    assert conv.prompt_tokens.mean() == pytest.approx(1201, abs=1)


def test_sharegpt_sample_edge_cases_counted():
    s = load_trace(TRACES / "sharegpt.sample.json", rate=5.0)
    accounted(s)
    st = s.stats
    assert (st.rows_read, st.rows_used, st.rows_filtered) == (200, 179, 21)
    notes = " | ".join(st.notes)
    assert "16 conversations with only a system turn" in notes
    assert "4 conversations with only assistant (gpt) turns" in notes
    assert "1 empty human turns" in notes
    assert "ESTIMATE" in notes and "default output-length model" in notes
    assert s.hashes_cover_output and s.hash_block_size == 16


def test_sharegpt_real_files():
    a = load_trace(shared("sharegpt/ShareGPT_V3_filtered_1000.json"), rate=10.0)
    accounted(a)
    assert len(a) == 1000
    b = load_trace(shared("sharegpt/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json"), rate=10.0)
    accounted(b)
    assert (b.stats.rows_read, len(b), b.stats.rows_filtered) == (2978, 2957, 21)


def test_sharegpt_multiturn_sessions_share_prefix():
    s = load_trace(DATA / "sharegpt_multiturn.json", rate=1.0, shuffle=False, think_time_s=5.0)
    accounted(s)
    assert (s.stats.rows_read, len(s), s.stats.rows_filtered) == (9, 5, 4)
    turns = np.flatnonzero(s.session_id == s.session_id[0])
    assert len(turns) == 3
    first, second, third = (s.hash_ids[i] for i in turns)
    # a later turn carries the earlier turns (and their answers) as a prefix
    assert second[: len(first) - 1] == first[:-1]
    assert third[: len(second) - 1] == second[:-1]
    assert s.prompt_tokens[turns[1]] > s.prompt_tokens[turns[0]] + s.output_tokens[turns[0]] - 2
    assert np.all(np.diff(s.arrival_s[turns]) > 0)
    # the same opening message in another conversation (no system prompt) does not share conv1's first block
    other = s.hash_ids[int(np.flatnonzero(s.session_id == 6)[0])]
    assert other[0] != first[0]


def test_sharegpt_output_lengths_from_csv():
    s = load_trace(TRACES / "sharegpt.sample.json", rate=5.0, output_lengths=TRACES / "sharegpt_lengths.sample.csv")
    assert "drawn from num_decode_tokens" in " ".join(s.stats.notes)
    assert s.output_tokens.max() <= 1024


def test_sharegpt_with_a_local_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = {"[UNK]": 0}
    for rec in json.loads((DATA / "sharegpt_multiturn.json").read_text()):
        for t in rec["conversations"]:
            for w in t["value"].split():
                words.setdefault(w, len(words))
    tok = tokenizers.Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    s = load_trace(DATA / "sharegpt_multiturn.json", rate=1.0, shuffle=False, tokenizer=folder)
    accounted(s)
    assert "token counts from tokenizer" in " ".join(s.stats.notes)
    human = ("What is the capital of France? Please answer in one word and then explain the history of the city "
             "in a couple of sentences.")
    system = "You are a helpful assistant that answers briefly."
    assert s.prompt_tokens[0] == len(system.split()) + len(human.split())


def test_lengths_csv():
    s = load_trace(TRACES / "sharegpt_lengths.sample.csv", rate=20.0, arrival="gamma", cv=2.0)
    accounted(s)
    assert len(s) == 10_000
    assert 15 < len(s) / s.arrival_s[-1] < 25


def test_burstgpt_both_schemas():
    new = load_trace(DATA / "burstgpt_new.csv")
    accounted(new)
    assert len(new) == 8 and new.session_id is not None  # 2 failed rows dropped by default
    assert "failed requests" in " ".join(new.stats.notes)
    old = load_trace(DATA / "burstgpt_old.csv", models=["ChatGPT"], log_types=["api"])
    accounted(old)
    assert len(old) == 5 and old.session_id is None
    kept = load_trace(DATA / "burstgpt_new.csv", keep_failed=True)
    assert len(kept) == 10 and int((kept.output_tokens == 1).sum()) == 2


def test_servegen_sample_window():
    s = load_trace(TRACES / "servegen_m-large", clients=[28], start_s=693000, duration_s=600, seed=3)
    assert s.stats.rows_read == 2016 and s.stats.rows_used == 1
    assert s.stats.rows_read == s.stats.rows_used + s.stats.rows_filtered
    # the window's measured rate is 89.73 req/s (53,836 requests in 600 s)
    assert len(s) == pytest.approx(53836, rel=0.05)
    assert s.arrival_s.min() >= 0 and s.arrival_s.max() < 600
    # lengths come from the client's 6-hour window holding 742800 s (key 734400) of the dataset JSON
    import ast
    dist = json.loads((TRACES / "servegen_m-large" / "chunk-28-dataset.json").read_text())["734400"]
    assert set(s.prompt_tokens.tolist()) <= set(ast.literal_eval(dist["input_tokens"]))
    assert set(s.output_tokens.tolist()) <= set(ast.literal_eval(dist["output_tokens"]))


def test_servegen_real_folders():
    folder = shared("servegen/reason/deepseek-r1")
    s = load_trace(folder, clients=[0, 1], duration_s=7200)
    assert len(s) > 0 and s.stats.rows_read == 288
    mm = load_trace(shared("servegen/multimodal/mm-image/chunk-5-trace.csv"), duration_s=1200)
    assert len(mm) > 0 and mm.prompt_tokens.min() >= 1
