"""Validation helpers of :mod:`saria.config` (a bad value raises ``ValueError`` naming the field)
and the admission rule names ``Policy.admission`` joins. Kept apart so that the config module
holds only the configuration's dataclasses; :mod:`saria.config` re-exports the public names."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ADMISSION_RULES", "admission_rules", "check_bool", "check_float", "check_int"]

# Policy.admission: rules joined by "+" (see saria.control.admission). "eq1" is the paper's Eq. 1;
# "session", "deferred", "prefix" and "cost" refine it; "oracle" (alone) sees the future and runs only in a replay.
ADMISSION_RULES = ("eq1", "session", "deferred", "prefix", "cost", "oracle")


def admission_rules(text: str) -> frozenset[str]:
    """The rules ``Policy.admission`` names (``"eq1+session+prefix"``); raises ``ValueError`` naming
    what is wrong. ``oracle`` stands alone; the refinements need ``eq1``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"Policy.admission must name rules joined by '+' ({', '.join(ADMISSION_RULES)}), "
                         f"got {text!r}")
    rules = [part.strip() for part in text.split("+")]
    unknown = [r for r in rules if r not in ADMISSION_RULES]
    if unknown:
        raise ValueError(f"Policy.admission: unknown rule(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(ADMISSION_RULES)} (joined by '+', e.g. eq1+session+prefix)")
    chosen = frozenset(rules)
    if "oracle" in chosen and len(chosen) > 1:
        raise ValueError(f"Policy.admission: oracle stands alone (it knows every future reuse), got {text!r}")
    if "oracle" not in chosen and "eq1" not in chosen:
        raise ValueError(f"Policy.admission: {text!r} refines nothing; the rules session, deferred, prefix and cost refine "
                         f"eq1 (write eq1+{'+'.join(sorted(chosen))})")
    return chosen


def check_int(owner: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}.{name} must be <= {maximum}, got {value}")


def check_float(owner: str, name: str, value: Any, minimum: float, *, strict: bool = False,
                 maximum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{owner}.{name} must be {'>' if strict else '>='} {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}.{name} must be <= {maximum}, got {value}")


def check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be a bool, got {value!r}")
