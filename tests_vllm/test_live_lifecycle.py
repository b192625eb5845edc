"""The launcher's engine-argument flags as vLLM 0.32's own parser reads them (no worker is started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm")

def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_engine_flags_are_what_vllms_own_parser_reads():
    """The launcher's flags for false and list values, parsed by vLLM 0.32's parser: a store_true flag's false is
    left out (--no-disable-log-stats was "unrecognized arguments"), a config field's false is --no-X, a JSON-typed
    list is one JSON value. The parser read through an interpreter (`FLAG_KINDS_SCRIPT`) is the recorded one."""
    from live.vllm_server import FLAG_KINDS_SCRIPT, VLLM_FLAGS, engine_flags, parse_flag_kinds

    out = subprocess.run([sys.executable, "-c", FLAG_KINDS_SCRIPT], capture_output=True, text=True, timeout=300)
    kinds = parse_flag_kinds(out.stdout, "this vLLM")
    assert kinds is not None, out.stdout[-2000:] + out.stderr[-2000:]
    assert (kinds.switches, kinds.json_values, kinds.switches_on) == (VLLM_FLAGS.switches, VLLM_FLAGS.json_values,
                                                                      VLLM_FLAGS.switches_on)
    args = {"disable_log_stats": False, "aggregate_engine_logging": False, "headless": False,
            "enable_prefix_caching": False, "enforce_eager": True, "allowed_origins": ["http://a", "http://b"],
            "allowed_methods": ["GET"], "api_key": ["k1", "k2"], "max_num_seqs": 4,
            "default_chat_template_kwargs": {"enable_thinking": False}}
    ns = vllm_parser().parse_args(["--model", "m"] + engine_flags(args, kinds))
    assert ns.disable_log_stats is False and ns.aggregate_engine_logging is False and ns.headless is False
    assert ns.enable_prefix_caching is False and ns.enforce_eager is True and ns.max_num_seqs == 4
    assert ns.allowed_origins == ["http://a", "http://b"] and ns.allowed_methods == ["GET"]
    assert ns.api_key == ["k1", "k2"] and ns.default_chat_template_kwargs == {"enable_thinking": False}
    assert vllm_parser().parse_args(["--model", "m"] + engine_flags({"disable_log_stats": True})).disable_log_stats
