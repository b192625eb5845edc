"""GPU specs: the numbers a roofline needs (peak FLOP/s per dtype, HBM size and bandwidth, NVLink)."""

from __future__ import annotations

from dataclasses import dataclass, field

from twin import specs
from twin.errors import TwinInputError, spec_entry_errors


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's datasheet numbers (dense peak FLOP/s, bytes, bytes/s)."""

    name: str
    peak_flops: dict[str, float]
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float  # total, bidirectional
    num_sms: int = 0
    source: str = ""
    aliases: tuple[str, ...] = field(default=())

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; a clear error if the GPU has no such tensor-core path."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise TwinInputError(
                f"GPU {self.name} has no {dtype} peak FLOP/s (known: {', '.join(self.peak_flops)})"
            ) from None


def known_gpus() -> list[str]:
    return list(specs.load("hardware.yaml"))


@spec_entry_errors("hardware.yaml")
def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by name or alias."""
    found = specs.resolve(specs.load("hardware.yaml"), name)
    if found is None:
        raise TwinInputError(f"unknown GPU {name!r} (known: {', '.join(known_gpus())})")
    key, e = found
    return GPUSpec(
        name=key,
        peak_flops={k: float(v) for k, v in e["peak_flops"].items()},
        hbm_bytes=float(e["hbm_bytes"]),
        hbm_bandwidth=float(e["hbm_bandwidth"]),
        nvlink_bandwidth=float(e["nvlink_bandwidth"]),
        num_sms=int(e.get("num_sms", 0)),
        source=e.get("source", ""),
        aliases=tuple(e.get("aliases", [])),
    )
