"""Privacy accounting for DP-SGD through opacus' accountants (RDP, PRV, GDP); nothing by hand.

    acct = PrivacyAccountant("rdp")
    for step in range(steps):
        ...; acct.step(noise_multiplier=1.1, sample_rate=256 / 60000)
    acct.epsilon(delta=1e-5)

    epsilon(1.1, 256 / 60000, steps=10_000, delta=1e-5)              # the same, in one call
    noise_multiplier_for(8.0, 1e-5, 256 / 60000, steps=10_000)        # sigma for a target epsilon

Needs ``opacus`` (``pip install 'fxmem[dpsgd]'``), imported on first use (it takes seconds).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["ACCOUNTANTS", "PrivacyAccountant", "epsilon", "noise_multiplier_for"]

ACCOUNTANTS = ("rdp", "prv", "gdp")  # opacus.accountants.create_accountant's mechanisms


def _opacus_accountant(name: Any):
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant: got {name!r}; allowed: {', '.join(repr(a) for a in ACCOUNTANTS)}")
    try:
        from opacus.accountants import create_accountant
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fxmem.dpsgd accounting needs opacus: pip install 'fxmem[dpsgd]' "
                          f"(or pip install opacus); import failed: {e}") from e
    return create_accountant(mechanism=name)


def _number(name: str, value: Any, low: float, high: float, low_open=True, high_open=False) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")
    return float(value)


def _steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"steps must be an int >= 0, got {value!r}")
    return value


class PrivacyAccountant:
    """Tracks the privacy spent by DP-SGD steps (Poisson-subsampled Gaussian mechanism) with an
    opacus accountant: ``"rdp"`` (Renyi DP; the default here, as in opacus'
    ``get_noise_multiplier``), ``"prv"`` (privacy random variables: tighter; the default of
    opacus' and fxmem's ``PrivacyEngine``) or ``"gdp"`` (Gaussian DP, asymptotic). ``opacus`` is
    the opacus accountant itself."""

    def __init__(self, accountant: str = "rdp"):
        self.accountant = accountant
        self.opacus = _opacus_accountant(accountant)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> "PrivacyAccountant":
        """Record ``steps`` steps with noise ``noise_multiplier`` (std / clipping_norm) and
        Poisson sampling rate ``sample_rate`` (expected batch size / dataset size)."""
        sigma = _number("noise_multiplier", noise_multiplier, 0.0, math.inf, high_open=True)
        q = _number("sample_rate", sample_rate, 0.0, 1.0)
        n = _steps(steps)
        if n:
            hist = self.opacus.history
            if hist and hist[-1][:2] == (sigma, q):
                hist[-1] = (sigma, q, hist[-1][2] + n)
            else:
                hist.append((sigma, q, n))  # opacus' own (noise_multiplier, sample_rate, steps) records
        return self

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.opacus.history)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        return list(self.opacus.history)

    def epsilon(self, delta: float, **kwargs: Any) -> float:
        """Epsilon spent so far at ``delta`` (0 before any step). ``kwargs`` go to the opacus
        accountant's ``get_epsilon`` (e.g. ``eps_error`` for PRV, ``alphas`` for RDP)."""
        d = _number("delta", delta, 0.0, 1.0, high_open=True)
        if not self.opacus.history:
            return 0.0
        return float(self.opacus.get_epsilon(delta=d, **kwargs))

    def state_dict(self) -> dict:
        """The accounting so far (plain data: the mechanism and opacus' history of
        ``(noise_multiplier, sample_rate, steps)``), for a checkpoint."""
        return {"accountant": self.accountant, "history": [list(h) for h in self.opacus.history]}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (the same mechanism only: histories do not convert)."""
        if not isinstance(state, dict) or set(state) != {"accountant", "history"}:
            raise ValueError(f"load_state_dict: expected a PrivacyAccountant.state_dict(), got {state!r}")
        if state["accountant"] != self.accountant:
            raise ValueError(f"load_state_dict: the state is a {state['accountant']!r} accountant's, this is "
                             f"{self.accountant!r}")
        history = [(_number("noise_multiplier", s, 0.0, math.inf, high_open=True),
                    _number("sample_rate", q, 0.0, 1.0), _steps(n)) for s, q, n in state["history"]]
        self.opacus.history[:] = history

    def __repr__(self) -> str:
        return f"PrivacyAccountant({self.accountant!r}, steps={self.steps})"


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            accountant: str = "rdp", **kwargs: Any) -> float:
    """Epsilon at ``delta`` after ``steps`` DP-SGD steps with ``noise_multiplier`` and Poisson
    ``sample_rate``, from an opacus accountant (``"rdp"``, ``"prv"``, ``"gdp"``)."""
    return PrivacyAccountant(accountant).step(noise_multiplier, sample_rate, steps).epsilon(delta, **kwargs)


def noise_multiplier_for(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                         accountant: str = "rdp", epsilon_tolerance: float = 0.01, **kwargs: Any) -> float:
    """The smallest noise multiplier (within ``epsilon_tolerance``) whose epsilon after
    ``steps`` steps stays at most ``target_epsilon``: opacus' ``get_noise_multiplier``."""
    _opacus_accountant(accountant)  # names a bad accountant before opacus does
    eps = _number("target_epsilon", target_epsilon, 0.0, math.inf, high_open=True)
    d = _number("delta", delta, 0.0, 1.0, high_open=True)
    q = _number("sample_rate", sample_rate, 0.0, 1.0)
    n = _steps(steps)
    if n == 0:
        raise ValueError("steps must be >= 1 to choose a noise multiplier")
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=eps, target_delta=d, sample_rate=q, steps=n,
                                      accountant=accountant, epsilon_tolerance=epsilon_tolerance, **kwargs))
