"""fxmem's options: one frozen object, parsed and validated in one place.

Sources, later ones winning: defaults < environment (``FXMEM_MEMORY_OPT_LEVEL``,
``FXMEM_MEMORY_OPT_CONFIG``, ``FXMEM_REPORT``) < the ``options=`` dict of ``torch.compile``.
Every bad value raises ``ValueError`` naming the key (the option, the environment variable, or the
config file), the value and what is allowed. The environment variables that are not options
(``FXMEM_MEASURE_SCRATCH``, ``FXMEM_KERNELS_TRITON``, ``FXMEM_SCAN_LOOP_MAX``) are read where
they act, and checked here too, so that a bad value fails the first compile instead of some
later graph.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from torch._dynamo.exc import ShortenTraceback

from fxmem_kernels._common import ENV_TRITON, env_flag

from .step_in_backward.runtime import check_optimizer

ENV_LEVEL = "FXMEM_MEMORY_OPT_LEVEL"
ENV_CONFIG = "FXMEM_MEMORY_OPT_CONFIG"
ENV_REPORT = "FXMEM_REPORT"
ENV_MEASURE = "FXMEM_MEASURE_SCRATCH"  # measure CPU convolutions' temporaries (fxmem.measurements)
ENV_CACHE = "FXMEM_CACHE"  # the folder of the measurements' cache (fxmem.measurements)
ENV_SCAN_LOOP_MAX = "FXMEM_SCAN_LOOP_MAX"  # the longest selective scan traced as a loop (fxmem.graph_breaks)
SCAN_LOOP_MAX = 256  # its default: the longest sequence whose selective scan Dynamo traces as eager's loop

INNER_COMPILERS = ("inductor", "eager")
LOWERING_PATTERNS = (
    "fused_linear_cross_entropy", "bias_gelu", "layer_norm", "rms_norm", "swiglu", "geglu", "dropout",
    "attention_dropout",
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
    def parse(cls, text: str, key: str = "config", source: str = "") -> "Rule":
        """A rule from its text; ``source`` (e.g. "in config file 'r.json'") goes into errors."""
        parts = text.strip().split(":")
        allowed = "'cluster:strategy:count', strategy 0/1/2, count -1 or a positive integer, e.g. 'add+gelu+:1:-1'"
        bad = ValueError(f"{_what(key)}: malformed rule {text!r}{' ' + source if source else ''}; expected {allowed}")
        if len(parts) != 3 or not parts[0]:
            raise bad
        cluster, strategy, count = parts
        try:
            s, c = int(strategy), int(count)
        except ValueError:
            raise bad from None
        if s not in _STRATEGIES or not (c == -1 or c > 0):
            raise bad
        return cls(cluster, s, c)


@dataclass(frozen=True)
class Options:
    level: int = 0  # 0: cheap ops + user rules; 1: layerwise recompute; 2: 1 + compromised plans
    config: tuple[Rule, ...] = ()
    memory_budget: int | float | None = None  # saved activation bytes (int) or a fraction (float in [0, 1])
    peak_budget: int | None = None  # bytes: the cheapest plan whose simulated step peak fits (not with memory_budget)
    fit: int | None = None  # device bytes: peak_budget = fit - weights - optimizer state (fxmem/fit.py)
    optimizer: str | None = None  # with fit: whose state to count (default "adamw")
    inner: str = "inductor"
    plan_shape: Mapping[str, tuple[int, ...]] | None = None
    microbatch_size: int | str | None = None  # None, a positive int, or "auto"
    # Pattern lowering to fxmem_kernels (fxmem/lowering/patterns.py): True, False, or a dict
    # pattern -> bool (patterns not named stay on). On by default for every pattern but dropout
    # (RECOMMENDED_LOWERING: seeded dropout draws other masks than aten's dropout for the same
    # seed); the norms always, the fused loss and SwiGLU/GeGLU by what their sizes say (unless
    # named), the others only where the plan with them peaks lower (fxmem.lowering.decide); under
    # autocast the fused loss is compared too, and the fused calls cast as autocast would
    # (fxmem/lowering/amp.py).
    lowering: bool | Mapping[str, bool] = field(default_factory=lambda: RECOMMENDED_LOWERING)
    ghost_clipping: bool = True
    # Inductor's layout optimization (channels-last copies of a conv graph's tensors, kept for the
    # backward too): None = Inductor's own choice at level 0 without budgets, off where memory was
    # asked for (level >= 1, memory_budget, peak_budget, fit): see ``inductor_layout``.
    layout_optimization: bool | None = None
    report: bool = False
    report_path: str | None = None
    strict: bool = False
    # A torch.optim optimizer whose step runs in the backward, one parameter at a time, as each
    # gradient is final (fxmem/step_in_backward.py): held as its runtime, ``InBackward``.
    step_in_backward: Any = None
    # Saved activations may be moved to host memory between the forward and the backward where
    # that meets a budget at less modelled time than recomputing (fxmem/remat/offload.py); without
    # a budget, the least peak that offloading reaches (fxmem/host_memory.py runs the copies).
    offload: bool = False

    def inductor_layout(self) -> bool | None:
        """Whether Inductor may change a conv graph's layouts (``layout_optimization``): the
        option where given; else off where the options ask for memory over speed (level >= 1 or
        a budget) and Inductor's own choice (None) at level 0. Its channels-last copies of
        contiguous inputs and weights are saved for the backward besides the originals (on CPU it
        converts every conv graph: ViT at tiny shapes peaks 1.6x eager with it, 0.98x without)."""
        if self.layout_optimization is not None:
            return self.layout_optimization
        return False if self.memory_first() else None

    def memory_first(self) -> bool:
        """The options ask for memory over speed: level >= 1, a budget, or offload."""
        return self.level >= 1 or self.offload or any(
            v is not None for v in (self.memory_budget, self.peak_budget, self.fit))

    def inductor_config(self) -> dict[str, Any]:
        """Inductor config patches for fxmem's compiles: ``layout_optimization`` as
        :meth:`inductor_layout` says, where it is not None; and, where memory comes first,
        ``allow_buffer_reuse`` off. With it on, Inductor's wrapper keeps a dead buffer's storage
        until a later buffer of the same size takes it over, alive through whatever runs between
        (an MoE backward held expert-sized buffers through the next layer's: docs/benchmarks.md);
        off, each buffer is freed at its last use and a new one is allocated, which an allocator
        serves from its free blocks (fxmem predicts that schedule from the code either way). An
        output written in place of a dead input (``inplace_buffers``) is kept: it costs nothing."""
        layout = self.inductor_layout()
        return {**({} if layout is None else {"layout_optimization": layout}),
                **({"allow_buffer_reuse": False} if self.memory_first() else {})}

    def key(self) -> str:
        """A stable string of every option: goes into cache keys."""
        return repr(tuple((f.name, getattr(self, f.name)) for f in fields(self)))


def _what(key: str) -> str:
    """How an error names ``key``: an environment variable by its name, an option quoted."""
    return f"environment variable {key}" if key.startswith("FXMEM_") else f"option {key!r}"


def _err(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_what(key)}: got {value!r}; allowed: {allowed}")


def did_you_mean(name: Any, known: Any) -> str:
    """``" did you mean 'level'?"`` for the known name closest to a misspelt ``name``; "" if none is close."""
    close = difflib.get_close_matches(name, list(known), n=1) if isinstance(name, str) else []
    return f" did you mean {close[0]!r}?" if close else ""


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
    source = ""
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.endswith(".json") or os.sep in text:
            items, source = _config_file(text, key), f"in config file {text!r}"
        else:
            items = [t for t in text.split(",") if t.strip()]
    else:
        raise _err(key, value, "a list of 'cluster:strategy:count' strings, a comma-separated string, or a JSON path")
    parsed: dict[str, Rule] = {}  # each distinct text parsed once
    rules = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{_what(key)}: got {item!r}{' ' + source if source else ''}; "
                             "allowed: 'cluster:strategy:count' strings")
        rule = parsed.get(item)
        if rule is None:
            rule = parsed[item] = Rule.parse(item, key, source)
        rules.append(rule)
    # Identical rules count once, at the last one's place: rules apply in order, the last for an
    # occurrence winning, so the earlier copies change nothing.
    return tuple(reversed(dict.fromkeys(reversed(rules))))


def _config_file(path: str, key: str) -> list:
    """The JSON list a config file holds; every error names the file."""
    where = f"{_what(key)}: config file {path!r}"
    allowed = "a JSON list of 'cluster:strategy:count' strings"
    if os.path.isdir(path):
        raise ValueError(f"{where} is a directory; allowed: a path to a file holding {allowed}")
    if not os.path.isfile(path):
        raise ValueError(f"{where} does not exist; allowed: a path to {allowed}, "
                         "or the strings inline, comma-separated")
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte {e.start}: {e.reason}); allowed: {allowed}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e}); allowed: {allowed}") from None
    except OSError as e:
        raise ValueError(f"{where} cannot be read ({e.strerror or e})") from None
    if not isinstance(items, list):
        raise ValueError(f"{where} holds {items!r}; allowed: the JSON file must hold a list of "
                         "'cluster:strategy:count' strings")
    return items


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
        number, unit = m.group(1), m.group(2).upper()
        if _UNITS[unit] == 1 and not re.fullmatch(r"-?\d+", number):  # "0.5": bytes come whole
            hint = f"; for a fraction of level 0's saved bytes pass the float {key}={float(number)!r}" \
                if key == "memory_budget" and 0 <= float(number) <= 1 else ""
            raise ValueError(f"{_what(key)}: got {value!r}; bytes must be a whole number{hint}; allowed: {allowed}")
        n = int(float(number) * _UNITS[unit])
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


def _parse_layout(value: Any, key: str = "layout_optimization") -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _err(key, value, "True, False, or None (off at level >= 1 and with budgets, else Inductor's choice)")
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
            raise ValueError(f"{_what(f'{key}.{name}')}: got {on!r};{did_you_mean(name, LOWERING_PATTERNS)} "
                             f"allowed: pattern names {', '.join(LOWERING_PATTERNS)}")
        _bool(f"{key}.{name}", on)
    return MappingProxyType(dict(value))


def _parse_report_path(value: Any, key: str = "report_path") -> str | None:
    """A file path (its folder is made when the first report is written, as ``open`` with
    ``mkdir -p`` would: a report path must never fail a compile)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise _err(key, value, "None or a file path, e.g. 'reports/mem.json'")
    path = os.fspath(value)
    if os.path.isdir(path):
        raise ValueError(f"{_what(key)}: {path!r} is a directory; allowed: a file path in it, e.g. "
                         f"{os.path.join(path, 'mem.json')!r} (each graph's report is written as "
                         "mem.<compile>.<n>.json)")
    return path


# Optimizer state per trainable byte, by optimizer ("fit" reserves it; reports' max_batch counts it).
OPTIMIZER_STATE = {None: 0, "sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def _parse_optimizer(value: Any, key: str = "optimizer") -> str | None:
    if value is not None and value not in OPTIMIZER_STATE:
        raise _err(key, value, ", ".join(repr(k) for k in OPTIMIZER_STATE))
    return value


_PARSERS = {
    "level": parse_level,
    "config": parse_config,
    "memory_budget": parse_budget,
    "peak_budget": lambda v: None if v is None else parse_bytes(v, "peak_budget"),
    "fit": lambda v: None if v is None else parse_bytes(v, "fit"),
    "optimizer": _parse_optimizer,
    "inner": _parse_inner,
    "plan_shape": _parse_plan_shape,
    "microbatch_size": _parse_microbatch,
    "lowering": _parse_lowering,
    "ghost_clipping": lambda v: _bool("ghost_clipping", v),
    "layout_optimization": _parse_layout,
    "report": lambda v: _bool("report", v),
    "report_path": _parse_report_path,
    "strict": lambda v: _bool("strict", v),
    "step_in_backward": check_optimizer,
    "offload": lambda v: _bool("offload", v),
}


def env_value(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """An environment variable's value without surrounding blanks; None when unset or blank (as
    for every fxmem variable: blank means unset)."""
    value = (os.environ if env is None else env).get(name, "").strip()
    return value or None


def parse_scan_loop_max(value: str | None) -> int:
    """``FXMEM_SCAN_LOOP_MAX``'s value (None: unset, :data:`SCAN_LOOP_MAX`): a whole number >= 0."""
    if value is None:
        return SCAN_LOOP_MAX
    if not re.fullmatch(r"[0-9]+", value):  # no sign, no fraction, no exponent
        raise OptionError(f"environment variable {ENV_SCAN_LOOP_MAX}: got {value!r}; allowed: a whole number >= 0, "
                          f"the longest sequence whose selective scan is traced as a loop (unset: {SCAN_LOOP_MAX})")
    return int(value)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The options the environment sets; the other variables fxmem reads are checked, not kept."""
    out: dict[str, Any] = {}
    if (level := env_value(ENV_LEVEL, env)) is not None:
        out["level"] = parse_level(level, key=ENV_LEVEL)
    if (config := env_value(ENV_CONFIG, env)) is not None:
        out["config"] = parse_config(config, key=ENV_CONFIG)
    if (report := env_value(ENV_REPORT, env)) is not None:
        out["report"] = env_flag(ENV_REPORT, report)
    env_flag(ENV_MEASURE, env.get(ENV_MEASURE), default=True)
    env_flag(ENV_TRITON, env.get(ENV_TRITON))
    parse_scan_loop_max(env_value(ENV_SCAN_LOOP_MAX, env))
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
            raise ValueError(f"option {key!r}: unknown option (value {value!r});{did_you_mean(key, _PARSERS)} "
                             f"allowed keys: {', '.join(_PARSERS)}")
        values[key] = _PARSERS[key](value)
    if values.get("memory_budget") is not None and values.get("peak_budget") is not None:
        raise ValueError(f"options 'memory_budget' ({values['memory_budget']!r}) and 'peak_budget' "
                         f"({values['peak_budget']!r}): give one; memory_budget caps the saved activations, "
                         "peak_budget the step's peak")
    budgets = [k for k in ("memory_budget", "peak_budget") if values.get(k) is not None]
    if values.get("fit") is not None and budgets:
        raise ValueError(f"options 'fit' and {budgets[0]!r}: give one; fit is the device's size, from which fxmem "
                         "derives the step's peak_budget (fit minus weights and optimizer state)")
    if values.get("optimizer") is not None and values.get("fit") is None:
        raise ValueError(f"option 'optimizer' ({values['optimizer']!r}) counts only with 'fit' (the optimizer state "
                         "it reserves on the device); allowed: give fit too, or leave optimizer out")
    return Options(**values)
