"""fxmem's options: one frozen object, parsed and validated in one place.

Sources, later ones winning: defaults < environment (``FXMEM_MEMORY_OPT_LEVEL``,
``FXMEM_MEMORY_OPT_CONFIG``, ``FXMEM_REPORT``) < the ``options=`` dict of ``torch.compile``.
Every bad value raises ``ValueError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from torch._dynamo.exc import ShortenTraceback

ENV_LEVEL = "FXMEM_MEMORY_OPT_LEVEL"
ENV_CONFIG = "FXMEM_MEMORY_OPT_CONFIG"
ENV_REPORT = "FXMEM_REPORT"

INNER_COMPILERS = ("inductor", "eager")
LOWERING_PATTERNS = (
    "fused_linear_cross_entropy", "bias_gelu", "layer_norm", "rms_norm", "swiglu", "geglu", "dropout",
)
RECOMMENDED_LOWERING = MappingProxyType({"dropout": False})
_STRATEGIES = {0: "none", 1: "recompute", 2: "compromised"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class OptionError(ValueError, ShortenTraceback):
    """A bad option found while compiling. Also a ShortenTraceback, so that Dynamo re-raises it
    as it is instead of wrapping it in BackendCompilerFailed."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.first_useful_frame = None


@dataclass(frozen=True)
class Rule:
    """One ``cluster:strategy:count`` entry of a memory-optimization config (ONNX Runtime's format).

    strategy: 0 none, 1 recompute, 2 compromised recompute. count: -1 every occurrence, else the
    first ``count`` occurrences in topological order.
    """

    cluster: str
    strategy: int
    count: int

    def __str__(self) -> str:
        return f"{self.cluster}:{self.strategy}:{self.count}"

    @classmethod
    def parse(cls, text: str, key: str = "config") -> "Rule":
        parts = text.strip().split(":")
        allowed = "'cluster:strategy:count', strategy 0/1/2, count -1 or a positive integer, e.g. 'add+gelu+:1:-1'"
        if len(parts) != 3 or not parts[0]:
            raise ValueError(f"option {key!r}: malformed rule {text!r}; expected {allowed}")
        cluster, strategy, count = parts
        try:
            s, c = int(strategy), int(count)
        except ValueError:
            raise ValueError(f"option {key!r}: malformed rule {text!r}; expected {allowed}") from None
        if s not in _STRATEGIES or not (c == -1 or c > 0):
            raise ValueError(f"option {key!r}: malformed rule {text!r}; expected {allowed}")
        return cls(cluster, s, c)


@dataclass(frozen=True)
class Options:
    level: int = 0  # 0: cheap ops + user rules; 1: layerwise recompute; 2: 1 + compromised plans
    config: tuple[Rule, ...] = ()
    memory_budget: int | float | None = None  # saved activation bytes (int) or a fraction (float in [0, 1])
    peak_budget: int | None = None  # bytes: the cheapest plan whose simulated step peak fits (not with memory_budget)
    inner: str = "inductor"
    plan_shape: Mapping[str, tuple[int, ...]] | None = None
    microbatch_size: int | str | None = None  # None, a positive int, or "auto"
    # Pattern lowering to fxmem_kernels (fxmem/lowering/patterns.py): True, False, or a dict
    # pattern -> bool (patterns not named stay on). On by default for every pattern but dropout
    # (RECOMMENDED_LOWERING: seeded dropout draws other masks than aten's dropout for the same
    # seed); the norms always, the fused loss and SwiGLU/GeGLU by what their sizes say (unless
    # named), the others only where the plan with them peaks lower (fxmem.backend._lower); under
    # autocast the fused loss is compared too, and the fused calls cast as autocast would
    # (fxmem/lowering/amp.py).
    lowering: bool | Mapping[str, bool] = field(default_factory=lambda: RECOMMENDED_LOWERING)
    ghost_clipping: bool = True
    report: bool = False
    report_path: str | None = None
    strict: bool = False

    def key(self) -> str:
        """A stable string of every option: goes into cache keys."""
        return repr(tuple((f.name, getattr(self, f.name)) for f in fields(self)))


def _err(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"option {key!r}: got {value!r}; allowed: {allowed}")


def _int(key: str, value: Any, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            return int(value)
        raise _err(key, value, allowed)
    return value


def parse_level(value: Any, key: str = "level") -> int:
    allowed = "0, 1 or 2"
    level = _int(key, value, allowed)
    if level not in (0, 1, 2):
        raise _err(key, value, allowed)
    return level


def parse_config(value: Any, key: str = "config") -> tuple[Rule, ...]:
    """Rules from a list of strings, a comma-separated string, or the path of a JSON list."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.endswith(".json") or os.sep in text:
            if not os.path.isfile(text):
                raise ValueError(f"option {key!r}: config file {text!r} does not exist; allowed: a path to "
                                 "a JSON list of 'cluster:strategy:count' strings, "
                                 "or the strings inline, comma-separated")
            try:
                with open(text) as f:
                    items = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"option {key!r}: config file {text!r} is not valid JSON ({e})") from None
            if not isinstance(items, list):
                raise _err(key, items, "the JSON file must hold a list of 'cluster:strategy:count' strings")
        else:
            items = [t for t in text.split(",") if t.strip()]
    else:
        raise _err(key, value, "a list of 'cluster:strategy:count' strings, a comma-separated string, or a JSON path")
    rules = []
    for item in items:
        if not isinstance(item, str):
            raise _err(key, item, "'cluster:strategy:count' strings")
        rules.append(Rule.parse(item, key))
    return tuple(rules)


def parse_bytes(value: Any, key: str) -> int:
    """``512MB``/``24GB`` (powers of 10) or ``1.5GiB`` (powers of 2) or an int of bytes."""
    allowed = "a non-negative number of bytes (int) or a string like '512MB', '24GB', '1.5GiB'"
    if isinstance(value, bool):
        raise _err(key, value, allowed)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in _UNITS:
            raise _err(key, value, allowed)
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise _err(key, value, allowed)
    if n < 0:
        raise _err(key, value, allowed)
    return n


def parse_budget(value: Any, key: str = "memory_budget") -> int | float | None:
    if value is None:
        return None
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise _err(key, value, "a fraction in [0, 1] of level 0's saved bytes, or bytes (int or '512MB')")
        return value
    return parse_bytes(value, key)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _err(key, value, "True or False")
    return value


def _parse_inner(value: Any, key: str = "inner") -> str:
    if value not in INNER_COMPILERS:
        raise _err(key, value, " or ".join(repr(c) for c in INNER_COMPILERS))
    return value


def _parse_plan_shape(value: Any, key: str = "plan_shape") -> Mapping[str, tuple[int, ...]] | None:
    allowed = "a dict from input or symbol name to a list of positive ints, e.g. {'input_ids': [64, 2048]}"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _err(key, value, allowed)
    out = {}
    for name, dims in value.items():
        dims = (dims,) if isinstance(dims, int) and not isinstance(dims, bool) else dims
        if (not isinstance(name, str) or not isinstance(dims, (list, tuple))
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)):
            raise _err(key, {name: dims}, allowed)
        out[name] = tuple(dims)
    return out


def _parse_microbatch(value: Any, key: str = "microbatch_size") -> int | str | None:
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _err(key, value, "None, a positive int, or 'auto'")
    return value


def _parse_lowering(value: Any, key: str = "lowering") -> bool | Mapping[str, bool]:
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise _err(key, value, "True, False, or a dict from pattern name to bool; "
                               f"patterns: {', '.join(LOWERING_PATTERNS)}")
    for name, on in value.items():
        if name not in LOWERING_PATTERNS:
            raise _err(f"{key}.{name}", on, f"pattern names {', '.join(LOWERING_PATTERNS)}")
        _bool(f"{key}.{name}", on)
    return MappingProxyType(dict(value))


def _parse_path(value: Any, key: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _err(key, value, "None or a path string")
    return value


_PARSERS = {
    "level": parse_level,
    "config": parse_config,
    "memory_budget": parse_budget,
    "peak_budget": lambda v: None if v is None else parse_bytes(v, "peak_budget"),
    "inner": _parse_inner,
    "plan_shape": _parse_plan_shape,
    "microbatch_size": _parse_microbatch,
    "lowering": _parse_lowering,
    "ghost_clipping": lambda v: _bool("ghost_clipping", v),
    "report": lambda v: _bool("report", v),
    "report_path": lambda v: _parse_path(v, "report_path"),
    "strict": lambda v: _bool("strict", v),
}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env.get(ENV_LEVEL, "").strip():
        out["level"] = parse_level(env[ENV_LEVEL].strip(), key=ENV_LEVEL)
    if env.get(ENV_CONFIG, "").strip():
        out["config"] = parse_config(env[ENV_CONFIG], key=ENV_CONFIG)
    if env.get(ENV_REPORT, "").strip():
        out["report"] = env[ENV_REPORT].strip().lower() not in ("0", "false", "no", "")
    return out


def resolve(options: Mapping[str, Any] | Options | None = None, env: Mapping[str, str] | None = None) -> Options:
    """Options from ``options=`` over the environment over the defaults."""
    if isinstance(options, Options):
        return options
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"options: got {options!r}; allowed: a dict of option names to values, or fxmem.Options")
    values = _from_env(os.environ if env is None else env)
    for key, value in options.items():
        if key not in _PARSERS:
            raise ValueError(f"option {key!r}: unknown option (value {value!r}); allowed keys: {', '.join(_PARSERS)}")
        values[key] = _PARSERS[key](value)
    if values.get("memory_budget") is not None and values.get("peak_budget") is not None:
        raise ValueError(f"options 'memory_budget' ({values['memory_budget']!r}) and 'peak_budget' "
                         f"({values['peak_budget']!r}): give one; memory_budget caps the saved activations, "
                         "peak_budget the step's peak")
    return Options(**values)
