"""Hints chosen from the symptom: what the answer returned, never which case failed.

A case is built to catch one mistake, but an answer fails it for its own reasons: a hint keyed by
the case ("this case tests an exact fit, so: >=, not >") names the case's mistake, which may not be
the answer's (a first fit over unsorted buckets fails that case too). So a chapter lists its known
mistakes as variants of the reference, each with the sentence that names it, and a hint names the
variants that return exactly what the answer returned; several are all named (the output cannot
tell them apart; naming one would guess); none: no hint (the report's comparison stands alone).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["symptom_hint", "name_matches", "first_difference"]


def name_matches(matches: Sequence[str]) -> Optional[str]:
    """One message alone; several all named, numbered (leaving one out could hide the answer's)."""
    matches = list(dict.fromkeys(matches))
    if len(matches) <= 1:
        return matches[0] if matches else None
    return (f"{len(matches)} different mistakes return exactly this; it is one of: "
            + "; ".join(f"({k}) {m}" for k, m in enumerate(matches, 1)))


def symptom_hint(mistakes: Sequence[tuple[dict, str]], variant: Callable, args: Sequence, expected: Any, got: Any,
                 same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> Optional[str]:
    """The messages of every known mistake ``(flags, message)`` whose ``variant(*args, **flags)``
    returns what the answer returned (``same(got, value)``) and not the expected value; a variant
    that raises (the mistake cannot happen on these inputs) matches nothing."""
    matches = []
    for flags, msg in mistakes:
        try:
            value = variant(*args, **flags)
            if same(got, value) and not same(expected, value):
                matches.append(msg)
        except Exception:  # noqa: BLE001 (a variant that cannot run here is no match)
            continue
    return name_matches(matches)


def first_difference(expected: Sequence, got: Sequence) -> Optional[int]:
    """Index of the first entry that differs or that one sequence lacks; None when equal."""
    for i, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))
