"""The roofline against measured H100 kernels: measurements never beat it, and the defaults track them.

Vidur's measured H100 operator profiles (../shared/profiles/vidur-h100/, MIT) time every linear layer of
Llama-2-7B and -70B by token count and tensor-parallel degree. If a measurement were faster than our ideal
roofline, our FLOP or byte accounting would be wrong.
"""

from pathlib import Path

import pandas as pd
import pytest

from twin.hardware import get_gpu
from twin.models import get_model

PROFILES = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "vidur-h100"
MATMULS = ["attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"]

pytestmark = pytest.mark.skipif(not PROFILES.exists(), reason=f"measured profiles not found at {PROFILES}")


def measured(name: str) -> pd.DataFrame:
    df = pd.read_csv(PROFILES / f"{name}.mlp.csv")
    df["linear_s"] = df[[f"time_stats.{op}.median" for op in MATMULS]].sum(axis=1) * 1e-3
    return df


@pytest.mark.parametrize("model,profile", [("Llama-2-7B", "llama-2-7b"), ("Llama-2-70B", "llama-2-70b")])
def test_no_measured_kernel_beats_the_ideal_roofline(model, profile):
    m, gpu = get_model(model), get_gpu("H100")
    df = measured(profile)
    tp = df["num_tensor_parallel_workers"]
    params = m.layer_linear_params / tp  # one GPU's share of one layer's matmul weights
    ideal = pd.concat([2 * params * df["num_tokens"] / gpu.flops("bf16"), 2 * params / gpu.hbm_bandwidth],
                      axis=1).max(axis=1)
    assert len(df) > 1000
    assert (df["linear_s"] >= ideal).all(), df.loc[df["linear_s"] < ideal, ["num_tokens", "linear_s"]]


def test_default_efficiencies_track_measured_compute_bound_layers():
    m, gpu = get_model("Llama-2-7B"), get_gpu("H100")
    df = measured("llama-2-7b")
    df = df[(df["num_tensor_parallel_workers"] == 1) & (df["num_tokens"] >= 1024)]
    p = m.layer_linear_params
    default = 2 * p * df["num_tokens"] / (gpu.flops("bf16") * 0.75)  # the default compute_efficiency
    ratio = df["linear_s"] / default
    # tile quantisation makes odd token counts up to ~24 % slower; the typical layer is within a few %
    assert ratio.between(0.9, 1.25).all(), ratio.describe()
    assert 0.95 <= ratio.median() <= 1.10
