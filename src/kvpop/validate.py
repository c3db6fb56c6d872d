"""Type and range checks of user arguments, made before any work starts (before a model loads).

Each bad argument is one error that names it: ``TypeError`` for a value of the wrong kind,
``ValueError`` for one out of range. Integral numbers of any type (``numpy.int64``, ...) count as
ints and are returned as ``int``; ``bool`` is never a number here (``lam=True`` is a mistake,
not 1.0). What depends on the model (its position limit) or on the policy (a learned scorer's
trained window) is checked where those are known; this module needs neither.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_int", "check_number", "check_prompts", "parse_shard"]


def check_int(name: str, value, minimum: int | None = None, *, optional: bool = True) -> int | None:
    """``value`` as an ``int`` (None stays None when ``optional``); any integral number is accepted."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def check_number(
    name: str,
    value,
    *,
    minimum: float | None = None,
    below: float | None = None,
    above: float | None = None,
    optional: bool = True,
) -> float | None:
    """``value`` as a finite ``float`` in range (``minimum <= value``, ``above < value < below``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if (
        (minimum is not None and value < minimum)
        or (above is not None and value <= above)
        or (below is not None and value >= below)
    ):
        if above is not None and below is not None:
            rng = f"in ({above:g}, {below:g})"
        elif minimum is not None:
            rng = f">= {minimum:g}"
        else:
            rng = f"> {above:g}" if above is not None else f"< {below:g}"
        raise ValueError(f"{name} must be {rng}, got {value:g}")
    return value


def check_prompts(prompt, name: str = "prompt") -> list[str]:
    """A prompt or a non-empty list of them, as a list; an empty prompt is an error (it has no token
    to start from: the model would fail on a 0-length input)."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"{name} must be a string or a non-empty list of strings, got {type(prompt).__name__}")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        where = "" if isinstance(prompt, str) else f" (item {empty[0]} of the list)"
        raise ValueError(f"{name} is empty{where}: give at least one character of text")
    return prompts


def parse_shard(shard) -> tuple[int, int] | None:
    """``"I/N"`` (or ``(I, N)``) as ``(I, N)`` with ``1 <= I <= N``: the I-th of N parts a command's work is split
    into (processes sharing an output folder); None stays None (the whole work)."""
    if shard is None:
        return None
    if isinstance(shard, str):
        try:
            i, n = (int(x) for x in shard.split("/"))
        except ValueError:
            raise ValueError(f"shard must look like I/N (e.g. 1/2), got {shard!r}") from None
    else:
        i, n = shard
    if not 1 <= i <= n:
        raise ValueError(f"shard {i}/{n}: need 1 <= I <= N")
    return i, n
