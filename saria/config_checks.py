"""Validation helpers of :mod:`saria.config` (a bad value raises ``ValueError`` naming the field)
and the admission rule names ``Policy.admission`` joins. Kept apart so that the config module
holds only the configuration's dataclasses; :mod:`saria.config` re-exports the public names."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ADMISSION_RULES", "admission_rules", "check_bool", "check_float", "check_int", "learned_join"]

# Policy.admission: rules joined by "+" (see saria.control.admission). "eq1" is the paper's Eq. 1;
# "session", "deferred", "prefix" and "cost" refine it; "learned" (a model trained on the oracle's
# labels) is joined to eq1 by "&" (both must admit: fewer writes) or "|" (either: more retention),
# as the one term "eq1&learned" or "eq1|learned"; "oracle" (alone) sees the future and runs only in a replay.
ADMISSION_RULES = ("eq1", "session", "deferred", "prefix", "cost", "learned", "oracle")
LEARNED_TERMS = {"eq1&learned": "and", "eq1|learned": "or", "learned&eq1": "and", "learned|eq1": "or"}


def _terms(text: str) -> list[str]:
    return ["".join(part.split()) for part in text.split("+")]


def learned_join(text: str) -> str | None:
    """How ``Policy.admission`` joins the ``learned`` rule to Eq. 1: ``"and"`` (``eq1&learned``),
    ``"or"`` (``eq1|learned``), or None (no learned rule). ``text`` must be valid
    (:func:`admission_rules`)."""
    for term in _terms(text):
        if term in LEARNED_TERMS:
            return LEARNED_TERMS[term]
    return None


def admission_rules(text: str) -> frozenset[str]:
    """The rules ``Policy.admission`` names (``"eq1+session+prefix"``, ``"eq1&learned+deferred"``);
    raises ``ValueError`` naming what is wrong. ``oracle`` stands alone; the refinements need
    ``eq1``; ``learned`` is joined to ``eq1`` by ``&`` or ``|`` (:func:`learned_join` says which)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"Policy.admission must name rules joined by '+' ({', '.join(ADMISSION_RULES)}), "
                         f"got {text!r}")
    rules = []
    joins = 0
    for term in _terms(text):
        if term in LEARNED_TERMS:
            rules += ["eq1", "learned"]
            joins += 1
        elif term == "learned":
            raise ValueError(f"Policy.admission: the learned rule is joined to eq1 by & (both admit: fewer writes) "
                             f"or | (either admits: more retention), as eq1&learned or eq1|learned, got {text!r}")
        elif "&" in term or "|" in term:
            raise ValueError(f"Policy.admission: {term!r}: only eq1&learned and eq1|learned join rules by & or |, "
                             f"got {text!r}")
        else:
            rules.append(term)
    if joins and (joins > 1 or rules.count("eq1") > 1):
        raise ValueError(f"Policy.admission: Eq. 1 and the learned rule are joined once (eq1&learned or "
                         f"eq1|learned), got {text!r}")
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
