"""The `whatif:` scenario section's four actions, validated by pydantic (twin.scenario.WhatIfSpec holds them).

Each action is off until its section is given: writing any of its keys (or `--set whatif.X.key=...`) turns it
on, `enabled: false` turns it off again. Values the twin cannot know are ASSUMPTIONS: their defaults are
conservative placeholders, to be set from your own measurements or from the paper a claim comes from; reports
list them (twin.whatif.model.WhatIfModel.describe).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, model_validator

from twin.spec_base import NumbersChecked

# links to host memory by name, bytes/s per direction (sources in twin/specs/hardware.yaml's header)
HOST_LINKS = {"pcie4-x16": 32e9, "pcie5-x16": 64e9, "nvlink-c2c": 450e9}


class _Action(NumbersChecked):
    """One action: `enabled` is true as soon as the section is written, unless it says otherwise."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = False

    @model_validator(mode="before")
    @classmethod
    def _on_when_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and "enabled" not in data:
            return {**data, "enabled": True}
        return data


class PrecisionSpec(_Action):
    """Per-layer FP8: the linear layers of `fp8_layers` (or an evenly spread `fp8_fraction` of the layers) run at
    the GPU's FP8 peak with 1-byte weights; the others at the 16-bit dtype. `kv_cache_fp8` stores the KV cache in
    FP8 (half the bytes). Accuracy is not simulated: `accuracy_note` is your own statement, copied to reports."""

    fp8_fraction: float = Field(1.0, ge=0, le=1, description="share of layers whose linear layers run FP8")
    fp8_layers: Optional[list[int]] = Field(None, description="named layer indices (0-based) instead of a fraction")
    kv_cache_fp8: bool = False
    accuracy_note: str = Field("", description="your accuracy evidence for this schedule; never invented")

    @model_validator(mode="after")
    def _layers(self) -> "PrecisionSpec":
        if self.fp8_layers is not None:
            if "fp8_fraction" in self.model_fields_set:
                raise ValueError("give fp8_fraction or fp8_layers, not both")
            if any(i < 0 for i in self.fp8_layers) or len(set(self.fp8_layers)) != len(self.fp8_layers):
                raise ValueError(f"@fp8_layers: layer indices must be distinct and >= 0, got {self.fp8_layers}")
        return self


class PartialKVSpec(_Action):
    """Per request: `hot_fraction` of the KV stays in HBM, `warm_fraction` lives quantised (`warm_bits`) in host
    memory and is fetched over the host link on demand, the rest (cold) is dropped (never attended)."""

    hot_fraction: float = Field(0.25, gt=0, le=1)
    warm_fraction: float = Field(0.5, ge=0, lt=1)
    warm_bits: Literal[2, 4, 8] = 4
    hit_rate: float = Field(0.0, ge=0, le=1, description=(
        "ASSUMPTION: share of the warm KV a step needs that is already staged in HBM (4-bit): no transfer"))
    fetch_share: float = Field(1.0, ge=0, le=1, description=(
        "ASSUMPTION: share of decode steps that attend (and so fetch) the warm KV"))
    overlap: float = Field(0.0, ge=0, le=1, description=(
        "ASSUMPTION: share of the transfer time hidden behind compute"))
    link: Literal["spec", "pcie4-x16", "pcie5-x16", "nvlink-c2c"] = Field(
        "spec", description="spec: the GPU's own host link (hardware.yaml host_link)")
    link_bandwidth_gbs: Optional[float] = Field(None, ge=0.01, description="GB/s per direction; overrides link")

    @model_validator(mode="after")
    def _fractions(self) -> "PartialKVSpec":
        if self.hot_fraction + self.warm_fraction > 1 + 1e-12:
            raise ValueError(f"hot_fraction + warm_fraction must be <= 1 (the rest is the cold, dropped share), "
                             f"got {self.hot_fraction} + {self.warm_fraction}")
        return self


class EarlyExitSpec(_Action):
    """A share of decode tokens leaves the network early, skipping its last layers (linear and attention)."""

    token_share: float = Field(0.5, ge=0, le=1, description="ASSUMPTION: share of decode tokens that exit early")
    layer_share: float = Field(0.4, ge=0, lt=1, description="ASSUMPTION: share of layers (the last ones) they skip")


class SemanticBatchingSpec(_Action):
    """Waiting requests are grouped (DBSCAN over log prompt and log predicted output length, a cap on the ratio of
    predicted outputs within a group) and queued group by group, oldest group first."""

    predictor: Literal["cap", "oracle"] = Field("cap", description=(
        "cap: the client's max_tokens (else max_model_len - prompt); oracle: the true output length"))
    eps: float = Field(0.3, gt=0, description="DBSCAN radius in log(1 + tokens) space")
    min_samples: int = Field(1, ge=1)
    prompt_weight: float = Field(1.0, ge=0, description="weight of log prompt length against log output length")
    max_new_tokens_ratio: float = Field(2.0, ge=1, description="largest / smallest predicted output in a group")
    window: int = Field(256, ge=2, description="the oldest never-scheduled waiting requests regrouped per arrival")
