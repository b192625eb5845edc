"""Model specs: the shapes from which FLOPs per token, weight bytes and KV bytes per token follow.

Dense and mixture-of-experts (MoE) decoder-only transformers. For an MoE model every layer's MLP is
`num_experts` gated experts of width `moe_intermediate_size`, of which a router picks `num_experts_per_tok`
per token (Mixtral, Qwen3-MoE; no shared experts). Counts below say whether they are *stored* (what the
weights occupy) or *active* (what one token's forward pass multiplies).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from twin import specs
from twin.errors import TwinInputError
from twin.specs import spec_entry_errors

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
# OCP MXFP4 (gpt-oss's MoE weights): 4-bit values plus one 8-bit scale per 32, i.e. 4.25 bits per weight. vLLM
# quantises only the MoE experts this way (attention, router, embeddings stay BF16) and on Hopper, which has no
# FP4 tensor cores, runs them as weight-only kernels at the 16-bit peak (vllm/model_executor/layers/quantization/
# mxfp4.py, `Mxfp4MoEMethod`: Marlin or triton_kernels backends below SM100)
MXFP4_BYTES = 4.25 / 8


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's config (as in its config.json)."""

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
    tie_word_embeddings: bool = False  # config.json: one matrix is both the embedding and the LM head
    num_experts: int = 0  # 0: dense MLP of `intermediate_size`
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_active_params: float = 0.0  # model card's active parameter count (MoE); 0: dense

    def __post_init__(self) -> None:
        """Shapes no model has are refused (a ValueError: `spec_entry_errors` names the file and the entry)."""
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_model_len"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)}")
        if not self.num_params > 0:
            raise ValueError(f"num_params must be > 0, got {self.num_params}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.num_experts < 0 or self.intermediate_size < 0:
            raise ValueError("num_experts and intermediate_size must be >= 0")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(f"an MoE model needs 0 < num_experts_per_tok <= num_experts ({self.num_experts}) and "
                             "moe_intermediate_size > 0")
        if not self.is_moe and self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be > 0 for a dense model, got {self.intermediate_size}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V for every layer: 2 x layers x KV heads x head dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int = 2, embedding_bytes: int = 2) -> float:
        """Bytes of all stored weights: matmuls at `dtype_bytes`, embedding and LM head at 16 bits
        (vLLM's FP8 quantisation leaves both in the model dtype)."""
        return self.linear_params * dtype_bytes + self.vocab_params * embedding_bytes

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Weights the LM head multiplies per sampled token (the embedding matrix itself when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def vocab_params(self) -> int:
        """Stored embedding + LM head weights: one matrix when tied, two when not."""
        return self.embedding_params * (1 if self.tie_word_embeddings else 2)

    @property
    def layer_attn_params(self) -> int:
        """One layer's attention projections: QKV and output."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        return q + kv + o

    @property
    def expert_params(self) -> int:
        """One gated MLP of the experts' width (gate, up, down projections); the dense MLP when not MoE."""
        width = self.moe_intermediate_size if self.is_moe else self.intermediate_size
        return 3 * self.hidden_size * width

    @property
    def router_params(self) -> int:
        """One layer's router (gate) matrix: hidden x experts."""
        return self.hidden_size * self.num_experts

    @property
    def layer_linear_params(self) -> int:
        """Stored matmul weights of one layer: attention projections, every expert (or the MLP), router."""
        experts = self.num_experts if self.is_moe else 1
        return self.layer_attn_params + experts * self.expert_params + self.router_params

    @property
    def layer_active_linear_params(self) -> int:
        """Matmul weights one token multiplies in one layer: attention, its top-k experts, the router."""
        experts = self.num_experts_per_tok if self.is_moe else 1
        return self.layer_attn_params + experts * self.expert_params + self.router_params

    @property
    def linear_params(self) -> int:
        """Stored matmul weights of all layers (no embedding, no LM head)."""
        return self.num_layers * self.layer_linear_params

    @property
    def active_linear_params(self) -> int:
        """Matmul weights one token multiplies across all layers (no LM head): FLOPs/token = 2x this."""
        return self.num_layers * self.layer_active_linear_params

    @property
    def total_params(self) -> int:
        """Every stored parameter the shapes imply (norms excluded: under 0.01 %)."""
        return self.linear_params + self.vocab_params


def known_models() -> list[str]:
    return list(specs.load("models.yaml"))


@spec_entry_errors("models.yaml")
def get_model(name: str) -> ModelSpec:
    """Look a model up by name or alias (e.g. a Hugging Face id)."""
    found = specs.resolve(specs.load("models.yaml"), name)
    if found is None:
        raise TwinInputError(f"unknown model {name!r} (known: {', '.join(known_models())})")
    key, e = found
    tied = e.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):  # bool("false") is True
        raise ValueError(f"tie_word_embeddings must be true or false, got {tied!r}")
    return ModelSpec(
        name=key,
        num_layers=_whole(e, "num_layers"),
        hidden_size=_whole(e, "hidden_size"),
        num_heads=_whole(e, "num_heads"),
        num_kv_heads=_whole(e, "num_kv_heads"),
        head_dim=_whole(e, "head_dim"),
        intermediate_size=_whole(e, "intermediate_size"),
        vocab_size=_whole(e, "vocab_size"),
        num_params=float(e["num_params"]),
        max_model_len=_whole(e, "max_model_len"),
        source=e.get("source", ""),
        aliases=tuple(e.get("aliases", [])),
        tie_word_embeddings=tied,
        num_experts=_whole(e, "num_experts", 0),
        num_experts_per_tok=_whole(e, "num_experts_per_tok", 0),
        moe_intermediate_size=_whole(e, "moe_intermediate_size", 0),
        num_active_params=float(e.get("num_active_params", 0.0)),
    )


def _whole(entry: dict, key: str, default: int | None = None) -> int:
    """A count field as an int; 1.5 is refused, not cut to 1 (a KeyError when missing and required)."""
    v = entry[key] if default is None else entry.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
        raise ValueError(f"{key} must be a whole number, got {v!r}")
    return int(v)
