"""Model specs: the shapes from which FLOPs per token, weight bytes and KV bytes per token follow."""

from __future__ import annotations

from dataclasses import dataclass, field

from twin import specs
from twin.errors import TwinInputError, spec_entry_errors

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer's config (as in its config.json)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: float
    max_model_len: int
    source: str = ""
    aliases: tuple[str, ...] = field(default=())

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V for every layer: 2 x layers x KV heads x head dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int = 2) -> float:
        return self.num_params * dtype_bytes

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's matmuls: QKV, output projection and the gated MLP."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q + kv + o + mlp

    @property
    def linear_params(self) -> int:
        """Matmul weights touched by every token (all layers; no embedding lookup, no LM head)."""
        return self.num_layers * self.layer_linear_params


def known_models() -> list[str]:
    return list(specs.load("models.yaml"))


@spec_entry_errors("models.yaml")
def get_model(name: str) -> ModelSpec:
    """Look a model up by name or alias (e.g. a Hugging Face id)."""
    found = specs.resolve(specs.load("models.yaml"), name)
    if found is None:
        raise TwinInputError(f"unknown model {name!r} (known: {', '.join(known_models())})")
    key, e = found
    return ModelSpec(
        name=key,
        num_layers=int(e["num_layers"]),
        hidden_size=int(e["hidden_size"]),
        num_heads=int(e["num_heads"]),
        num_kv_heads=int(e["num_kv_heads"]),
        head_dim=int(e["head_dim"]),
        intermediate_size=int(e["intermediate_size"]),
        vocab_size=int(e["vocab_size"]),
        num_params=float(e["num_params"]),
        max_model_len=int(e["max_model_len"]),
        source=e.get("source", ""),
        aliases=tuple(e.get("aliases", [])),
    )
