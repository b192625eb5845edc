"""The router protocol, a base class with no-op hooks, and the registry that names routers in scenarios.

A router is small and pure: `choose(req, fleet)` reads views and returns an instance id or a `Reject`.
Hooks tell it what happened to the requests it placed. New routers register by name (`@register_router`)
or are loaded from the user's own code (`router.name: my_pkg.routers:Mine` or `path/to/file.py:Mine`),
without touching the simulator or the live controller.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

from twin.policy.views import FleetView, Reject, RequestView


@runtime_checkable
class Router(Protocol):
    name: str

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject: ...


class RouterBase:
    """Optional base: hooks are no-ops. `prefix_index` says which index the router reads, if any
    ("approximate", "precise" or "any": the world builds it; "any" takes the scenario's choice).
    `reads_gauges` False: `choose` never reads the scraped gauges, so the simulator keeps none for it."""

    name: ClassVar[str] = "router"
    prefix_index: ClassVar[str | None] = None
    reads_gauges: bool = True

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_dispatch(self, req: RequestView, instance_id: str, now: float) -> None:
        pass

    def on_first_token(self, req: RequestView, instance_id: str, now: float) -> None:
        pass

    def on_finish(self, req: RequestView, instance_id: str, now: float, output_tokens: int) -> None:
        pass


ROUTERS: dict[str, type] = {}
ALIASES: dict[str, str] = {}


def register_router(name: str, *aliases: str) -> Callable[[type], type]:
    """Class decorator: make a router available by `name` (and aliases) in scenarios and live configs."""

    def deco(cls: type) -> type:
        ROUTERS[name] = cls
        for a in aliases:
            ALIASES[a] = name
        return cls

    return deco


def _load_object(ref: str, kind: str = "router") -> Any:
    """`pkg.module:Name` or `path/to/file.py:Name`; `kind` (router, scaler, ...) names what it is in errors."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise KeyError(ref)
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise LookupError(f"{kind} file {target} does not exist")
        mod_name = f"llmtwin_user_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise LookupError(f"cannot load {target} as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise LookupError(f"cannot import {target}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise LookupError(f"{target} has no {attr}") from None


def resolve_router_class(name: str) -> type:
    """The class behind a registry name, an alias, or a `module:Class` / `file.py:Class` reference."""
    key = ALIASES.get(name, name)
    if key in ROUTERS:
        return ROUTERS[key]
    if ":" in name:
        obj = _load_object(name)
        if not callable(obj):
            raise LookupError(f"{name} is not a class or factory")
        return obj
    raise KeyError(name)


def canonical_name(name: str) -> str:
    return ALIASES.get(name, name)


def router_params(cls: type) -> dict[str, Any]:
    """Constructor parameters and their defaults (`inspect.Parameter.empty` where required)."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and not p.name.startswith("_")}


def make_router(name: str, seed: int | None = None, **params: Any) -> Router:
    """Build a router by name; `seed` is passed when the router takes one and params do not set it.

    Raises KeyError for an unknown name, LookupError for a user reference that cannot be loaded,
    TypeError (naming the accepted parameters) for parameters the router does not take and `ParamError` (a
    ValueError naming the parameter) for a value of the wrong kind or out of range.
    """
    return router_from(name, seed, params)


def router_from(name: str, seed: int | None, params: dict[str, Any]) -> Router:
    """`make_router` with the parameters as a dict, so they may hold their own `seed` (which then wins).

    Parameter values are judged by their defaults' kinds before the router is built (`judge_params`); a value
    refused there or by the constructor's own `ParamError` raises `ParamError` naming the parameter."""
    cls = resolve_router_class(name)
    accepted = router_params(cls)
    if seed is not None and "seed" in accepted and "seed" not in params:
        params = {**params, "seed": seed}
    return construct(cls, params, f"router {name!r}", accepted)


def construct(cls: Any, params: dict[str, Any], what: str, accepted: dict[str, Any] | None = None) -> Any:
    """`cls(**params)` for a policy (a router, scaler, load predictor): a parameter it does not take is a
    TypeError naming `what` and what it takes, and the values are judged by their defaults' kinds first
    (`judge_params`, raising `ParamError`). `accepted`: `router_params(cls)`, where the caller has it."""
    if accepted is None:
        accepted = router_params(cls)
    unknown = [k for k in params if k not in accepted]
    if unknown and not _takes_kwargs(cls):
        raise TypeError(f"{what} {takes_no(accepted, unknown)}")
    return cls(**judge_params(cls, params))


def takes_no(accepted: dict[str, Any], unknown: list[str]) -> str:
    """What a policy's builder says of parameters it does not take: `takes no parameter 'x' (it takes: a=1, b)`."""
    takes = ", ".join(f"{k}={v!r}" if v is not inspect.Parameter.empty else k for k, v in accepted.items())
    return f"takes no parameter {', '.join(map(repr, unknown))} (it takes: {takes or 'none'})"


def _takes_kwargs(cls: type) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return True


def has_hook(router: Any, name: str) -> bool:
    """The router has hook `name` and it is not RouterBase's no-op (skipping no-ops keeps dispatch cheap)."""
    fn = getattr(type(router), name, None)
    return fn is not None and fn is not getattr(RouterBase, name)


class ParamError(ValueError):
    """A policy parameter's value refused: `param` names it (dotted below a nested one, `inner.params.seed`),
    `reason` says why. Constructors raise it; the builders say `router.params.<param>: <reason>` (or scaler.params,
    predictor.params) in one line. A plain ValueError or TypeError from a constructor reads `router.params: ...`."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason

    def below(self, outer: str) -> "ParamError":
        """The same refusal, for a policy built inside another's parameter `outer` (e.g. `inner.params`)."""
        return ParamError(f"{outer}.{self.param}", self.reason)


def require(ok: bool, param: str, reason: str) -> None:
    """Refuse parameter `param` unless `ok` (write `ok` so that NaN fails it: `0 < q <= 1`, not `not q <= 0`)."""
    if not ok:
        raise ParamError(param, reason)


def require_finite(param: str, v: Any, low: float, strict: bool = True) -> None:
    """Refuse `v` unless it is finite and above `low` (at least `low` with `strict` False); NaN fails."""
    ok = low < v < math.inf if strict else low <= v < math.inf
    require(ok, param, f"must be a finite number {'>' if strict else '>='} {low:g}, got {v}")


def as_number(param: str, v: Any, integer: bool = False) -> int | float:
    """`v` as a number (never NaN, never true/false); a string that reads as one is taken (YAML 1.1 reads `1e-3`
    as a string); `integer`: a whole number, as an int (`1.5` is refused, `2.0` and `"1e3"` are taken)."""
    x = v
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            raise ParamError(param, f"{v!r} is not a number") from None
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or math.isnan(x):
        raise ParamError(param, f"{v!r} is not a number")
    if integer:
        if isinstance(x, numbers.Integral):
            return int(x)
        if not math.isfinite(x) or x != int(x):
            raise ParamError(param, f"{v!r} is not a whole number")
        return int(x)
    return float(x) if isinstance(v, str) else x


def _allows_none(p: inspect.Parameter) -> bool:
    """None is a value the parameter declares (`float | None`, `Optional[int]`), or it declares nothing."""
    a = p.annotation
    if a is inspect.Parameter.empty:
        return True
    text = a if isinstance(a, str) else repr(a)
    return "None" in text or "Optional" in text


def judge_params(cls: Any, params: dict) -> dict:
    """`params` judged by the kind of each constructor parameter's default, before the constructor runs: a
    true/false default takes only true or false (a quoted "false" is truthy: it silently turned a feature on), an
    int default a whole number (made an int), a float default a number (a string that reads as one is taken:
    YAML 1.1 reads `1e-3` as a string); never NaN. Parameters without such a default (a user's own, a name,
    a mapping) are passed as given. Returns the parameters with the values taken; raises `ParamError`."""
    if not params:  # the common case, and a forecast builds a cluster (so a router) per candidate
        return {}
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return dict(params)
    out = dict(params)
    for k, v in params.items():
        p = sig.parameters.get(k)
        if p is None or p.default is inspect.Parameter.empty or p.default is None:
            continue
        d = p.default
        if not isinstance(d, (bool, int, float)):
            continue
        if v is None and _allows_none(p):
            continue
        if isinstance(d, bool):
            if not isinstance(v, bool):
                raise ParamError(k, f"{v!r} is not true or false")
        else:
            out[k] = as_number(k, v, integer=isinstance(d, int))
    return out


def param_types_problem(cls: Any, params: dict, prefix: str) -> str | None:
    """The first parameter whose value is not of its default's kind, as one line (`judge_params`), or None."""
    try:
        judge_params(cls, params)
    except ParamError as e:
        return f"{prefix}.{e}"
    return None


def policy_error(e: BaseException, prefix: str) -> str:
    """A constructor's refusal as one line: `prefix.<param>: <reason>` for a `ParamError`, else `prefix: <error>`."""
    return f"{prefix}.{e}" if isinstance(e, ParamError) else f"{prefix}: {e}"


def check_seed(seed: Any, param: str = "seed") -> int:
    """A seed as a scenario's: a whole number >= 0."""
    n = as_number(param, seed, integer=True)
    require(n >= 0, param, f"must be >= 0, got {n}")
    return n


def build_router(spec: Any, seed: int | None) -> Router:
    """A scenario's or live config's `router:` block as a router; bad names or parameters are one line."""
    from twin.errors import TwinInputError

    try:
        return router_from(spec.name, seed, dict(spec.params))
    except KeyError:
        raise TwinInputError(f"router.name: unknown router {spec.name!r}") from None
    except LookupError as e:
        raise TwinInputError(f"router.name: {e}") from None
    except TwinInputError:
        raise
    except (TypeError, ValueError) as e:
        raise TwinInputError(policy_error(e, "router.params")) from None


def prefix_index_kind(router: Any, wanted: str | None) -> str | None:
    """The prefix index to build: none for routers that read none, else the configured or the router's choice."""
    pref = getattr(router, "prefix_index", None)
    if pref is None:
        return None
    if wanted is not None:
        return wanted
    return "approximate" if pref == "any" else pref


def hook(router: Any, name: str) -> Callable[..., None] | None:
    """The router's hook `name`, or None for routers without it (plain objects need not subclass)."""
    return getattr(router, name, None)
