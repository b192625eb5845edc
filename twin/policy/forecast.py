"""Load predictors for scalers: the next interval's arrival rate from recent per-interval rates.

`constant` (the last value), `moving-average`, `holt-winters` (exponential smoothing with trend) and `arima`
(both from statsmodels, the `[plan]` extra), as Dynamo's planner offers. Pure: they read a list of floats.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class LoadPredictor(Protocol):
    name: str

    def predict(self, history: Sequence[float]) -> float:
        """The next value of the series (e.g. req/s in the next interval)."""
        ...


class Constant:
    name = "constant"

    def predict(self, history: Sequence[float]) -> float:
        return float(history[-1]) if history else 0.0


class MovingAverage:
    name = "moving-average"

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window

    def predict(self, history: Sequence[float]) -> float:
        h = list(history)[-self.window:]
        return sum(h) / len(h) if h else 0.0


def _statsmodels():
    try:
        import statsmodels.tsa.api as tsa
    except ImportError:
        raise ImportError("this load predictor needs statsmodels: pip install 'llmtwin[plan]'") from None
    return tsa


def _one_step(history: Sequence[float], min_history: int, model) -> float:
    """A statsmodels model's one-step forecast (never negative); a 3-point moving average while history is short
    or flat, where the fit is meaningless."""
    h = [float(x) for x in history]
    if len(h) < min_history or max(h) == min(h):
        return MovingAverage(3).predict(h)
    tsa = _statsmodels()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return max(0.0, float(model(tsa, h).fit().forecast(1)[0]))


class HoltWinters:
    """Additive-trend exponential smoothing (statsmodels `ExponentialSmoothing`); falls back while history is short."""

    name = "holt-winters"

    def __init__(self, min_history: int = 6) -> None:
        self.min_history = min_history

    def predict(self, history: Sequence[float]) -> float:
        return _one_step(history, self.min_history,
                         lambda tsa, h: tsa.ExponentialSmoothing(h, trend="add", initialization_method="estimated"))


class Arima:
    """ARIMA(p, d, q) one-step forecast (statsmodels); falls back while history is short."""

    name = "arima"

    def __init__(self, order: tuple[int, int, int] = (1, 1, 0), min_history: int = 8) -> None:
        self.order = tuple(order)
        self.min_history = min_history

    def predict(self, history: Sequence[float]) -> float:
        return _one_step(history, self.min_history, lambda tsa, h: tsa.ARIMA(h, order=self.order))


LOAD_PREDICTORS = {"constant": Constant, "moving-average": MovingAverage, "holt-winters": HoltWinters,
                   "arima": Arima}


def make_load_predictor(name: str, **params) -> LoadPredictor:
    if name not in LOAD_PREDICTORS:
        raise KeyError(name)
    return LOAD_PREDICTORS[name](**params)
