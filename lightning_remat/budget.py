"""Memory budgets as users write them: bytes, ``"4GiB"``, ``"512MB"``, ``"60%"``, or None.

:class:`Budget` is the one place a budget is read: made once from what the user wrote (and
checked then, before any profiling), and turned into bytes once per graph against the plain
step's peak (a fraction) or the device's free memory (None). ``remat()``, the strategies,
the batch-size search, the command line and the benchmarks all resolve it here, so a
percentage is the same bytes everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

__all__ = ["ACCEPTED_FORMS", "NAMED_BUDGET_ROOM", "Budget", "format_bytes", "parse_budget", "validate_budget",
           "with_room"]


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
ACCEPTED_FORMS = (
    "an int number of bytes (4294967296 or '4294967296'), a size string ('4GiB', '512MB', "
    "'1.5 GiB'), or a fraction of the plain step's peak ('60%', or in (0, 1]: 0.6 or '0.6')"
)
NAMED_BUDGET_ROOM = 0.01
"""What a budget a refusal names holds beyond the smallest one that held where it was
found. Given again, the budget is met by a new profile (the solvers that weigh time place
stages on its measured times: the smallest budget of one model moved by up to 0.11%
between profiles on a 2-core CPU under load) and by a new first step (whose excess over
the prediction varies between plans by bytes to pages)."""


def with_room(nbytes: int) -> int:
    """The budget to name for a smallest budget of ``nbytes`` (:data:`NAMED_BUDGET_ROOM`)."""
    return int(int(nbytes) * (1 + NAMED_BUDGET_ROOM)) + 1


_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*|%)\s*$")


def parse_budget(budget: int | float | str | None, plain_peak_bytes: int | None = None) -> int | None:
    """Bytes a budget stands for. ``None`` stays ``None`` (no limit). Percentages, and
    floats in (0, 1] or the strings that spell them (``"0.5"``), are fractions of
    ``plain_peak_bytes``, which must then be given; a bare whole number is bytes."""
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise ValueError(f"memory_budget={budget!r} is not a budget; accepted: {ACCEPTED_FORMS}")
    fraction: float | None = None
    if isinstance(budget, int):
        nbytes = budget
    elif isinstance(budget, float):
        if not 0 < budget <= 1:
            _refuse_fraction(budget)
        fraction = budget
        nbytes = 0
    elif isinstance(budget, str):
        match = _PATTERN.match(budget)
        if not match:
            raise ValueError(f"memory_budget={budget!r} is not understood; accepted: {ACCEPTED_FORMS}")
        number, unit = float(match.group(1)), match.group(2)
        if not unit and "." in match.group(1):
            # A bare decimal means what the float it spells does: a fraction.
            if not 0 < number <= 1:
                _refuse_fraction(budget)
            fraction = number
            nbytes = 0
        elif unit == "%":
            if not 0 < number <= 100:
                raise ValueError(f"memory_budget={budget!r}: a percentage must be in (0, 100]; "
                                 f"accepted: {ACCEPTED_FORMS}")
            fraction = number / 100
            nbytes = 0
        else:
            factor = _UNITS.get(unit.lower())
            if factor is None:
                raise ValueError(
                    f"memory_budget={budget!r}: unknown unit {unit!r}; accepted: {ACCEPTED_FORMS}"
                )
            nbytes = int(number * factor)
    else:
        raise ValueError(f"memory_budget={budget!r} has type {type(budget).__name__}; accepted: {ACCEPTED_FORMS}")
    if fraction is not None:
        if plain_peak_bytes is None:
            raise ValueError(
                f"memory_budget={budget!r} is relative to the plain step's peak, which is not "
                "known here; give bytes or a size string instead"
            )
        nbytes = int(fraction * plain_peak_bytes)
    if nbytes <= 0:
        raise ValueError(f"memory_budget={budget!r} must be positive; accepted: {ACCEPTED_FORMS}")
    return nbytes


def _refuse_fraction(budget: float | str) -> NoReturn:
    raise ValueError(
        f"memory_budget={budget!r}: a bare decimal is a fraction of the plain peak in (0, 1]; "
        f"accepted: {ACCEPTED_FORMS}"
    )


def validate_budget(budget: int | float | str | None) -> None:
    """Raise the ValueError parse_budget would, without knowing the plain peak yet."""
    parse_budget(budget, plain_peak_bytes=2**50)


@dataclass(frozen=True)
class Budget:
    """A memory budget as the user wrote it (``written``): an int number of bytes, a size
    string (``"4GiB"``), a fraction of the plain step's peak (``"60%"``, ``0.6``, ``"0.6"``)
    or None (the device's free memory; no limit where the device reports none). Checked
    when made: a malformed budget raises ``ValueError`` naming the accepted forms."""

    written: int | float | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.written, Budget):
            object.__setattr__(self, "written", self.written.written)
        validate_budget(self.written)

    @classmethod
    def of(cls, budget: int | float | str | Budget | None) -> Budget:
        """``budget`` as a :class:`Budget` (one already made is returned as it is)."""
        return budget if isinstance(budget, Budget) else cls(budget)

    @property
    def relative(self) -> bool:
        """Whether it is a fraction of the plain step's peak, not bytes."""
        if self.written is None:
            return False
        return parse_budget(self.written, 2**40) != parse_budget(self.written, 2**41)

    @property
    def from_device(self) -> bool:
        """Whether it is the device's free memory (written as None)."""
        return self.written is None

    def resolve(self, plain_peak_bytes: int | Callable[[], int] | None = None,
                free_memory: Callable[[], int | None] | None = None) -> int | None:
        """Its bytes: a fraction of ``plain_peak_bytes`` (a count, or a function that
        gives it, called only for a fraction), the reading of ``free_memory()`` for None
        (no function: no limit, None), else the bytes written."""
        if self.written is None:
            return None if free_memory is None else free_memory()
        if self.relative and callable(plain_peak_bytes):
            plain_peak_bytes = plain_peak_bytes()
        return parse_budget(self.written, plain_peak_bytes if self.relative else None)

    def absolute(self, why: str) -> int | None:
        """Its bytes where only bytes mean anything (``why`` says where): a fraction is
        refused with a ``ValueError`` that says so; None stays None."""
        if self.relative:
            raise ValueError(f"memory_budget={self.written!r} is a fraction of the plain step's peak, "
                             f"which {why}; give bytes or a size string such as '6GiB' or 512 * 2**20")
        return self.resolve()

    def __str__(self) -> str:
        return "the device's free memory" if self.written is None else str(self.written)


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number above 1 (``'1.50 GiB'``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
