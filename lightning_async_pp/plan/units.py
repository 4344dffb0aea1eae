"""How the planner's tables write numbers: seconds in the unit that shows them, parameter counts in K, M or B.

Its own module so that the report (report.py) and the tensor-parallel section (tensor.py), which the report
includes, both write them without importing each other."""
from __future__ import annotations


def fmt_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_count(n: float) -> str:
    """A parameter count in the unit that shows it: 10.31 B, 134.5 M, 7.2 K (not 0.00 B for a small model)."""
    for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f}"
