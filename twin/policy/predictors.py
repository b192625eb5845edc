"""Output-length predictors: request view -> predicted output tokens (and, for some, quantiles).

A predictor sees only the `RequestView` (prompt length, session, prefix, text where the world has it, the
client's `max_tokens` cap); the true length reaches it only through `observe` after the request finished,
or, for the `oracle`, through an explicit `reveal` by the world before `predict`. Every prediction except the
oracle's is clipped to [1, max_tokens] (the engine never generates past the cap).

Plain Python and numpy: no simulator imports. The `model` predictor loads a trained model file made by
`twin predictor train` (twin.predict, imported only when such a predictor is built).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left, bisect_right
from collections import deque
from statistics import NormalDist
from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

import numpy as np

from twin.errors import TwinInputError
from twin.policy.base import ParamError, check_seed, judge_params
from twin.policy.views import RequestView


@runtime_checkable
class LengthPredictor(Protocol):
    """One interface for every predictor; `quantiles(req, qs)` is optional (see `has_quantiles`)."""

    name: str

    def predict(self, req: RequestView) -> float: ...

    def observe(self, req: RequestView, output_tokens: int) -> None: ...


def has_quantiles(p: Any) -> bool:
    return callable(getattr(p, "quantiles", None))


class MissingTruth(LookupError):
    """The oracle was asked about a request whose true length the world did not reveal."""


def _clip(req: RequestView, x: float) -> float:
    x = max(float(x), 1.0)
    return x if req.max_tokens is None else min(x, float(req.max_tokens))


class PredictorBase:
    """Optional base: `observe` is a no-op; `needs_truth` says the world must `reveal` lengths first."""

    name: ClassVar[str] = "predictor"
    is_oracle: ClassVar[bool] = False
    needs_truth: bool = False

    def predict(self, req: RequestView) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def observe(self, req: RequestView, output_tokens: int) -> None:
        pass

    def describe(self) -> str:
        """How reports name this predictor."""
        return self.name


class SessionTracker:
    """Turn index and earlier output lengths per session, learned from the requests a predictor sees.

    A request's turn is fixed the first time its id is seen (0 for the first request of a session, or for
    requests without a session); `history` lists the observed output lengths of the session's earlier turns.
    """

    def __init__(self) -> None:
        self._next_turn: dict[str, int] = {}
        self._turn_of: dict[str, int] = {}
        self._history: dict[str, list[int]] = {}

    def turn(self, req: RequestView) -> int:
        if req.session_id is None:
            return 0
        t = self._turn_of.get(req.id)
        if t is None:
            t = self._next_turn.get(req.session_id, 0)
            self._next_turn[req.session_id] = t + 1
            self._turn_of[req.id] = t
        return t

    def history(self, req: RequestView) -> list[int]:
        return [] if req.session_id is None else self._history.get(req.session_id, [])

    def observe(self, req: RequestView, output_tokens: int) -> None:
        if req.session_id is None:
            return
        self.turn(req)  # a request observed without a prediction still takes its turn
        self._turn_of.pop(req.id, None)
        self._history.setdefault(req.session_id, []).append(int(output_tokens))


class Oracle(PredictorBase):
    """The true length, handed over by the world with `reveal(request_id, true_tokens)` before `predict`.

    An upper bound for studies, never a deployable policy: reports must say "oracle".
    """

    name = "oracle"
    is_oracle = True
    needs_truth = True

    def __init__(self) -> None:
        self._truth: dict[str, int] = {}

    def reveal(self, request_id: str, true_tokens: int) -> None:
        self._truth[str(request_id)] = int(true_tokens)

    def predict(self, req: RequestView) -> float:
        try:
            return float(self._truth[req.id])
        except KeyError:
            raise MissingTruth(f"oracle: the true length of request {req.id!r} was not revealed "
                               "(the world must call reveal(request_id, true_tokens) before predict)") from None

    def quantiles(self, req: RequestView, qs: Sequence[float]) -> list[float]:
        return [self.predict(req)] * len(qs)

    def observe(self, req: RequestView, output_tokens: int) -> None:
        self._truth.pop(req.id, None)


class Constant(PredictorBase):
    """The same length for every request (clipped to the request's cap)."""

    name = "constant"

    def __init__(self, value: float = 256.0) -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
            raise TwinInputError(f"constant predictor: value must be a number >= 1 (got {value!r})")
        self.value = float(value)

    def predict(self, req: RequestView) -> float:
        return _clip(req, self.value)

    def quantiles(self, req: RequestView, qs: Sequence[float]) -> list[float]:
        return [self.predict(req)] * len(qs)

    def describe(self) -> str:
        return f"constant {self.value:g}"


# ASSUMPTION: what the learning predictors say before they have observed anything (user-settable: `prior`).
DEFAULT_PRIOR_TOKENS = 256.0


def _prior(kind: str, prior: Any) -> float:
    """A learning predictor's `prior` (tokens): a finite number >= 0 (NaN failed at the first prediction)."""
    if not (isinstance(prior, (int, float)) and not isinstance(prior, bool) and 0 <= prior < math.inf):
        raise TwinInputError(f"{kind} predictor: prior must be a finite number >= 0 (got {prior!r})")
    return float(prior)


class Mean(PredictorBase):
    """The running mean of the observed output lengths (`prior` until the first observation)."""

    name = "mean"

    def __init__(self, prior: float = DEFAULT_PRIOR_TOKENS) -> None:
        self.prior = _prior("mean", prior)
        self.count = 0
        self.total = 0.0

    def predict(self, req: RequestView) -> float:
        return _clip(req, self.total / self.count if self.count else self.prior)

    def observe(self, req: RequestView, output_tokens: int) -> None:
        self.count += 1
        self.total += float(output_tokens)


class ResidualLengths:
    """The expected output length of a request still running, from recent completions' lengths.

    A request that has made `done` tokens is longer than `done`: its expected length is the mean of the recent
    lengths above `done` (the empirical mean residual life), not the plain mean. With the plain mean, the
    forecasts ended every request already past it at its next token, and the requests still running are the
    long ones: a backlog drained too early and the forecast read optimistic (`benchmarks/forecast_accuracy.py`).
    At `done` 0 it is the plain mean. Past the longest recent length, an ASSUMPTION: memoryless, `done` + the
    mean. Both worlds use it: the simulator's forks (`twin.sim.forecaster`) and the live shadow twin's requests
    in flight (`live.shadow.with_in_flight`)."""

    __slots__ = ("_sorted", "_suffix", "mean")

    def __init__(self, lengths: Sequence[float]) -> None:
        self._sorted = sorted(float(x) for x in lengths if x > 0)
        n = len(self._sorted)
        suffix = [0.0] * (n + 1)  # suffix[i]: the sum of the i-th smallest length and those above it
        for i in range(n - 1, -1, -1):
            suffix[i] = suffix[i + 1] + self._sorted[i]
        self._suffix = suffix
        self.mean: float | None = suffix[0] / n if n else None

    def __len__(self) -> int:
        return len(self._sorted)

    def expected(self, done: int) -> float | None:
        """The mean recent length above `done` (None: no lengths recorded)."""
        n = len(self._sorted)
        if not n:
            return None
        i = bisect_right(self._sorted, done)
        if i < n:
            return self._suffix[i] / (n - i)
        return done + self._suffix[0] / n


def within_context(prompts: np.ndarray, outputs: np.ndarray, max_model_len: int) -> np.ndarray:
    """`outputs` ending where the context does (at least one token), as vLLM ends a request at max_model_len
    (FINISHED_LENGTH_CAPPED): forecast lengths drawn or predicted past it cannot fit a cache sized for it. The same
    array when none passes it."""
    room = np.maximum(1, int(max_model_len) - prompts)
    return outputs if bool(np.all(outputs <= room)) else np.minimum(outputs, room)


def stop_for(predicted: float, done: int) -> int:
    """The stop length a forecast gives a request predicted to produce `predicted` tokens, `done` of them already:
    never below one more than it produced."""
    return max(int(math.ceil(predicted)), done + 1)


def expected_stop(own: float | None, cap: int | None, done: int, lengths: ResidualLengths | None,
                  default: float) -> int:
    """The length a forecast runs a request to once it has made `done` tokens: its own prediction (a length
    predictor's) while that is ahead of `done`; else the mean recent length above `done` (`lengths`, `default`
    when there are none), within the client's `cap`; at least `done` + 1. The cap is a bound, not an estimate:
    a request ends at the first of its own stop and its cap. The simulator's forks and the live shadow twin
    both use it (`twin.sim.forecaster.SimForecaster._predictor`, `live.shadow.with_in_flight`)."""
    if own is not None and own > done:
        return stop_for(own, done)
    e = lengths.expected(done) if lengths is not None else None
    if e is None:
        e = default
    if cap is not None:
        e = min(e, cap)
    return stop_for(e, done)


class _Window:
    """The last `size` observations, with a sorted copy made only when asked after a change."""

    __slots__ = ("values", "_sorted")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self._sorted: list[float] | None = None

    def add(self, x: float) -> None:
        self.values.append(x)
        self._sorted = None

    def quantile(self, q: float) -> float:
        """Linear interpolation between order statistics (numpy's default method)."""
        if self._sorted is None:
            self._sorted = sorted(self.values)
        s = self._sorted
        pos = q * (len(s) - 1)
        i = int(pos)
        if i >= len(s) - 1:
            return s[-1]
        return s[i] + (pos - i) * (s[i + 1] - s[i])


class BucketQuantile(PredictorBase):
    """Empirical quantiles of observed lengths per bucket: floor(log2(prompt tokens)) x session turn index.

    Learned online from `observe`. A bucket with fewer than `min_count` observations falls back to the
    prompt-length bucket over all turns, then to the global distribution, then to `prior`. Each bucket keeps
    its last `window` observations (so it follows drift). `q` is the quantile `predict` returns (0.5: the
    median, which minimises absolute error). Turns >= `max_turn` share one bucket.
    """

    name = "bucket-quantile"

    def __init__(self, q: float = 0.5, min_count: int = 20, window: int = 1000, max_turn: int = 3,
                 prior: float = DEFAULT_PRIOR_TOKENS) -> None:
        if not 0 <= q <= 1:
            raise TwinInputError(f"bucket-quantile predictor: q must be in [0, 1] (got {q!r})")
        if min_count < 1 or window < 1 or max_turn < 0:
            raise TwinInputError("bucket-quantile predictor: min_count and window must be >= 1, max_turn >= 0")
        self.q = float(q)
        self.min_count = int(min_count)
        self.window = int(window)
        self.max_turn = int(max_turn)
        self.prior = _prior("bucket-quantile", prior)
        self.sessions = SessionTracker()
        self._buckets: dict[tuple[int, int], _Window] = {}
        self._prompt_buckets: dict[int, _Window] = {}
        self._global = _Window(self.window)

    def bucket(self, req: RequestView) -> tuple[int, int]:
        return (int(math.log2(max(req.num_prompt_tokens, 1))), min(self.sessions.turn(req), self.max_turn))

    def _source(self, req: RequestView) -> _Window | None:
        key = self.bucket(req)
        for w in (self._buckets.get(key), self._prompt_buckets.get(key[0]), self._global):
            if w is not None and len(w.values) >= self.min_count:
                return w
        return self._global if self._global.values else None

    def quantiles(self, req: RequestView, qs: Sequence[float]) -> list[float]:
        w = self._source(req)
        return [_clip(req, self.prior if w is None else w.quantile(float(q))) for q in qs]

    def predict(self, req: RequestView) -> float:
        return self.quantiles(req, (self.q,))[0]

    def observe(self, req: RequestView, output_tokens: int) -> None:
        key = self.bucket(req)
        x = float(output_tokens)
        for store, k in ((self._buckets, key), (self._prompt_buckets, key[0])):
            w = store.get(k)  # type: ignore[call-overload]
            if w is None:
                w = store[k] = _Window(self.window)  # type: ignore[index]
            w.add(x)
        self._global.add(x)
        self.sessions.observe(req, output_tokens)

    def counts(self) -> dict[tuple[int, int], int]:
        return {k: len(w.values) for k, w in self._buckets.items()}


def _uniform(seed: int, request_id: str) -> float:
    """A uniform draw in (0, 1) fixed by (seed, request id): the same request gets the same error whatever
    else the run does (two routers compared under noise see the same mistakes)."""
    h = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") + 0.5) / 2.0 ** 64


def lognormal_sigma(error_rate: float) -> float:
    """sigma with E|exp(sigma Z) - 1| = error_rate for Z ~ N(0, 1): that mean is exp(s^2/2)(2 Phi(s) - 1)."""
    def mean_err(s: float) -> float:
        return math.exp(s * s / 2) * math.erf(s / math.sqrt(2))

    lo, hi = 0.0, 1.0
    while mean_err(hi) < error_rate:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_err(mid) < error_rate else (lo, mid)
    return (lo + hi) / 2


class Noisy(PredictorBase):
    """Another predictor's answer times a seeded random error factor, for sensitivity studies.

    `error_rate` r is the mean of |factor - 1| (so wrapping the oracle gives mean |pred - true| / true = r,
    before clipping to [1, max_tokens]). dist "uniform": factor = 1 + U(-2r, 2r), unbiased (mean 1), needs
    r <= 0.5; "lognormal": factor = exp(sigma Z), median 1, any r >= 0. The factor of a request is a function
    of (seed, request id) only.
    """

    name = "noisy"

    def __init__(self, inner: "str | LengthPredictor" = "oracle", error_rate: float = 0.25, seed: int = 0,
                 dist: str = "uniform", inner_params: dict | None = None) -> None:
        if isinstance(inner, str):
            if inner == "noisy":
                raise TwinInputError("noisy predictor: inner must be another kind of predictor")
            if inner_params is not None and not isinstance(inner_params, dict):
                raise TwinInputError(f"noisy predictor: inner_params must be a mapping (got {inner_params!r})")
            try:
                inner = predictor_from(inner, inner_params or {})
            except ParamError as e:
                raise e.below("inner_params") from None
        elif inner_params:
            raise TwinInputError("noisy predictor: inner_params apply only when inner is a predictor name")
        if not (isinstance(error_rate, (int, float)) and 0 <= error_rate < math.inf):
            raise TwinInputError(f"noisy predictor: error_rate must be a finite number >= 0 (got {error_rate!r})")
        if dist not in ("uniform", "lognormal"):
            raise TwinInputError(f"noisy predictor: dist must be uniform or lognormal (got {dist!r})")
        if dist == "uniform" and error_rate > 0.5:
            raise TwinInputError(f"noisy predictor: a uniform error factor needs error_rate <= 0.5 (got "
                                 f"{error_rate:g}; its factor would go below 0); use dist=lognormal")
        self.inner = inner
        self.error_rate = float(error_rate)
        self.seed = check_seed(seed)
        self.dist = dist
        self._sigma = lognormal_sigma(self.error_rate) if dist == "lognormal" and error_rate > 0 else 0.0
        self.needs_truth = bool(getattr(inner, "needs_truth", False))
        if hasattr(inner, "reveal"):
            self.reveal = inner.reveal  # type: ignore[attr-defined]

    def factor(self, request_id: str) -> float:
        if self.error_rate == 0:
            return 1.0
        u = _uniform(self.seed, request_id)
        if self.dist == "uniform":
            return 1.0 + 2.0 * self.error_rate * (2.0 * u - 1.0)
        return math.exp(self._sigma * NormalDist().inv_cdf(u))

    def predict(self, req: RequestView) -> float:
        return _clip(req, self.inner.predict(req) * self.factor(req.id))

    def quantiles(self, req: RequestView, qs: Sequence[float]) -> list[float]:
        f = self.factor(req.id)
        if has_quantiles(self.inner):
            return [_clip(req, x * f) for x in self.inner.quantiles(req, qs)]  # type: ignore[attr-defined]
        return [self.predict(req)] * len(qs)

    def observe(self, req: RequestView, output_tokens: int) -> None:
        self.inner.observe(req, output_tokens)

    def describe(self) -> str:
        inner = self.inner.describe() if hasattr(self.inner, "describe") else getattr(self.inner, "name", "?")
        return f"noisy {inner}, mean error {self.error_rate:.0%} ({self.dist})"


class ModelPredictor(PredictorBase):
    """A trained model saved by `twin predictor train` (xgboost or text); it predicts the median.

    The model's features (prompt tokens, session turn and earlier output lengths, text features) come from
    the request view and from this predictor's own `SessionTracker`, as in training. Cost per request on
    one CPU thread (measured on a shared 2-core machine): xgboost about 3 ms, text about 60 ms (an encoder
    pass); `prime(texts)` embeds known prompts in batches first.
    """

    name = "model"

    def __init__(self, path: str) -> None:
        from twin.predict.registry import load_model  # heavy imports stay out of the policy layer

        self.path = str(path)
        self.model = load_model(path)
        self.sessions = SessionTracker()
        self._cache: dict[str, list[float]] = {}

    def quantiles(self, req: RequestView, qs: Sequence[float]) -> list[float]:
        # the request's quantiles at the model's trained levels, interpolated (flat outside them)
        levels = self.model.quantile_levels
        got = self._cache.get(req.id)
        if got is None:
            got = self.model.predict_request(req.num_prompt_tokens, self.sessions.turn(req),
                                             self.sessions.history(req), req.text)
            self._cache[req.id] = got
        out = []
        for q in qs:
            j = bisect_left(levels, q)
            if j == 0:
                v = got[0]
            elif j >= len(levels):
                v = got[-1]
            else:
                a, b = levels[j - 1], levels[j]
                v = got[j - 1] + (q - a) / (b - a) * (got[j] - got[j - 1])
            out.append(_clip(req, v))
        return out

    def predict(self, req: RequestView) -> float:
        return self.quantiles(req, (0.5,))[0]

    def prime(self, texts: Sequence[str]) -> None:
        """Prepare for requests with these prompt texts (the text model embeds them in batches)."""
        if hasattr(self.model, "prime"):
            self.model.prime(texts)

    def observe(self, req: RequestView, output_tokens: int) -> None:
        self._cache.pop(req.id, None)
        self.sessions.observe(req, output_tokens)

    def describe(self) -> str:
        return f"model {self.model.kind} ({self.path})"


PREDICTORS: dict[str, Callable[..., Any]] = {
    "oracle": Oracle,
    "constant": Constant,
    "mean": Mean,
    "bucket-quantile": BucketQuantile,
    "noisy": Noisy,
    "model": ModelPredictor,
}


def predictor_from(name: str, params: dict[str, Any]) -> Any:
    """A predictor by registry name, its parameters judged by their defaults' kinds first
    (`twin.policy.base.judge_params`): raises TwinInputError for a bad name, a parameter it does not take or a value
    its constructor refuses, and `ParamError` (naming the parameter) for a value of the wrong kind."""
    cls = PREDICTORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise TwinInputError(f"unknown length predictor {name!r} (known: {', '.join(PREDICTORS)})")
    params = judge_params(cls, params)
    try:
        return cls(**params)
    except TypeError as e:
        import inspect

        takes = [p for p in inspect.signature(cls).parameters]
        raise TwinInputError(f"length predictor {name!r}: {e} (it takes: {', '.join(takes) or 'none'})") from None


def make_predictor(name: str, **params: Any) -> Any:
    """Build a predictor by registry name (a scenario's or live config's `predictor:`); a bad name or parameter
    is one clear TwinInputError (`predictor.params.<name>: ...` for a value of the wrong kind)."""
    try:
        return predictor_from(name, params)
    except ParamError as e:
        raise TwinInputError(f"predictor.params.{e}") from None


def evaluate(predictions: Sequence[float], truth: Sequence[float]) -> dict[str, float]:
    """Block's metrics: mean absolute error, mean error rate |pred - true| / true, Acc-50 and Acc-100
    (share of predictions within 50 / 100 tokens of the truth)."""
    p = np.asarray(predictions, dtype=np.float64)
    t = np.asarray(truth, dtype=np.float64)
    if len(p) != len(t) or len(t) == 0:
        raise TwinInputError("evaluate: predictions and truth must be non-empty and of equal length")
    err = np.abs(p - t)
    return {"n": int(len(t)), "mae": float(err.mean()), "error_rate": float((err / np.maximum(t, 1)).mean()),
            "acc50": float((err <= 50).mean()), "acc100": float((err <= 100).mean())}
