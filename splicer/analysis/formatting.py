"""How the tables and reports write a change with its interval: '+2.7 % [+1.9, +3.5]', 'n.s.' when the interval
includes 0, the reason when there is none (table.py, report.py and the later stages' sections all write them so)."""

from __future__ import annotations

import math


def fmt_change(
    x: float, lo: float | None, hi: float | None, scale: float = 100, unit: str = " %", digits: int | None = None
) -> str:
    """'+2.7 % [+1.9, +3.5]': two decimals where every figure is below 10 (so a small interval is not shown as 0.0)."""
    small = max(abs(scale * v) for v in (x, lo, hi) if v is not None) < 10
    d = digits if digits is not None else 2 if small else 1
    text = f"{scale * x:+.{d}f}{unit}"
    return text + (f" [{scale * lo:+.{d}f}, {scale * hi:+.{d}f}]" if lo is not None and hi is not None else "")


def fmt_change_verdict(
    x, lo, hi, verdict, scale: float, unit: str, quiet: str, digits: int | None = None, note: str | None = None
) -> str:
    """fmt_change, with `quiet` after it when the interval includes 0 (verdict False), or the note saying why there is
    no interval (too few sequences or groups)."""
    if x is None:
        return ""
    return fmt_change(x, lo, hi, scale, unit, digits) + (
        f" {quiet}" if verdict is False else f" ({note})" if note and lo is None else ""
    )


def _zero_unsigned(x: float | None, scale: float, digits: int) -> float | None:
    """x, or 0.0 where it prints as zero: a difference that rounds to 0 is printed '+0.0', never '-0.0'."""
    return 0.0 if x is not None and round(scale * x, digits) == 0 else x


def _point_digits(values, most: int = 3) -> int:
    """Decimals for figures in points printed side by side: one, or more where a nonzero figure would print as 0, so
    that an interval's end keeps its sign ('+0.06 [-0.01, +0.13]', not '+0.1 [+0.0, +0.1]' beside 'not significant')."""
    d = 1
    for v in values:
        while v and round(100 * v, d) == 0 and d < most:
            d += 1
    return d


def _paired_parts(cmp: dict) -> tuple[str, str | None]:
    """(the difference in points with its interval, or alone; why it has no interval, or None)."""
    lo, hi = cmp.get("ci") or (None, None)
    d = _point_digits((lo, hi))
    diff, lo, hi = (_zero_unsigned(x, 100, d) for x in (cmp["diff"], lo, hi))
    text = fmt_change(diff, lo, hi, 100, "", d)
    if lo is not None:
        return text, None
    why = cmp.get("why")
    if why and cmp.get("discordant") != 0:  # identical_pairs' why says itself that there is no interval
        why = f"{why} for an interval"
    return text, why


def fmt_paired_pp(cmp: dict | None) -> str:
    """A paired difference of two shares in points, for a table cell: '+1.1 [-1.4, +3.6] n.s.', or the difference and
    why it has no interval: '+0.0 (fewer than 5 items for an interval)', '+0.0 (no item differs from the build's: no
    interval)' (cmp: diff, ci, significant, why; metrics.identical_pairs)."""
    if not cmp or cmp.get("diff") is None:
        return ""
    text, why = _paired_parts(cmp)
    if why:
        return f"{text} ({why})"
    return text + (" n.s." if cmp.get("significant") is False else "")


def fmt_paired_clause(cmp: dict | None, against: str = "against the build") -> str:
    """The same difference in a report's sentence: '+1.1 [-1.4, +3.6] pp against the build, not significant', or
    without an interval '+0.0 pp against the build (no item differs from the build's: no interval)': a difference
    without an interval gets no verdict either way."""
    if not cmp or cmp.get("diff") is None:
        return ""
    text, why = _paired_parts(cmp)
    text = f"{text} pp" + (f" {against}" if against else "")
    if why:
        return f"{text} ({why})"
    if cmp.get("ci") is None:
        return text
    return text + ("" if cmp.get("significant") else ", not significant")


def fmt_share(fig: dict | None, digits: int = 1) -> str:
    """A share with its interval, in percent: '71.2 % [68.0, 74.4]' (fig: value, ci); '' when it has no value."""
    if not fig or fig.get("value") is None:
        return ""
    ci = fig.get("ci")
    text = f"{100 * fig['value']:.{digits}f} %"
    return text + (f" [{100 * ci[0]:.{digits}f}, {100 * ci[1]:.{digits}f}]" if ci else "")


def decimals(values, significant: int, of=min, least: int = 4, most: int = 8) -> int:
    """Decimals that give `significant` digits to the smallest (of=min) or largest (of=max) nonzero |value| of one
    output, so that figures printed side by side share a scale and their differences show: KLs of 0.00207 and 0.00209
    at 5 decimals, where 4 print both as 0.0021. Never fewer than `least` (a KL of 0.4544 prints as before), never more
    than `most` (a value near 0 by chance must not stretch every column)."""
    nonzero = [abs(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v != 0]
    if not nonzero:
        return least
    return min(most, max(least, significant - 1 - math.floor(math.log10(of(nonzero)))))


def fmt_other_dtypes(reference: str, dtype: str | None, rows: dict, what: str, hint: str) -> str | None:
    """The sentence for rows (name -> the dtype its engine computed in, None where not recorded) whose dtype is not
    the reference engine's, or None when none is, or the reference's is not known: vLLM's dtype="auto" follows each
    checkpoint's config (GPTQ exports often say float16), so those rows' `what` hold the dtypes' difference beside the
    quantization's; hint: the option that puts every engine in one dtype."""
    other = {n: d for n, d in rows.items() if dtype and d and d != dtype}
    if not other:
        return None
    listed = ", ".join(f"{n} ({d})" for n, d in other.items())
    return (
        f"Computed in another dtype than {reference} ({dtype}): {listed}; their {what} include that difference beside "
        f"the quantization's ({hint})."
    )
