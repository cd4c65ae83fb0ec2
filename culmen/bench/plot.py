"""Figures of a ``culmen bench`` run: one per benchmark family, plus an overview.

Every figure shows speed relative to the best peer of each case: a provider's value is
``best peer wall time / provider wall time``, so the best peer sits exactly on the line at 1.0,
culmen's bar reaches past it where culmen wins (its value is the ``speedup`` of the table) and the
other peers fall below it. The axis is logarithmic, so 0.5x and 2x lie equally far from the line.

``write_plot(report, "out/bench.png")`` writes ``out/bench-<family>.png`` for every family with
timed records (one row per case, grouped by benchmark) and ``out/bench.png`` itself as the overview
(one row per benchmark: geometric mean of culmen's ratio, with the range over its cases).
``load_report(json_path)`` reads a report written by ``culmen bench --json`` back, so committed
results can be drawn again (``culmen bench --from-json RUN.json --plot OUT.png``).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from culmen.bench.registry import CULMEN
from culmen.bench.runner import BenchReport, Record

# Figure geometry, in inches (savefig at DPI): wide enough for case labels, ROW_IN per bar.
WIDTH_IN = 12.0
ROW_IN = 0.3
HEAD_IN = 1.6
LEGEND_IN = 0.3
DPI = 100
# Fixed colours per provider, so the same peer looks the same in every figure; others cycle.
_PEER_STYLE = {
    "torch": ("tab:blue", "o"),
    "compile": ("tab:orange", "s"),
    "liger": ("tab:purple", "D"),
    "apex": ("tab:brown", "^"),
}
_CYCLE = [("tab:cyan", "v"), ("tab:pink", "P"), ("tab:olive", "X"), ("tab:gray", "h"), ("black", "<")]
_WIN, _LOSE = "tab:green", "tab:red"
_TICKS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0,
          100.0, 200.0, 500.0, 1000.0)
_FINE_TICKS = (0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.5, 3.0, 4.0, 5.0)


@dataclass
class CaseRatios:
    """One case of one benchmark: each provider's wall time relative to the case's best peer."""

    benchmark: str
    case: str
    best_peer: str | None
    ratios: dict[str, float] = field(default_factory=dict)
    """``provider -> best peer ms / provider ms`` (>1: faster than the best peer)."""
    failed: dict[str, str] = field(default_factory=dict)
    """``provider -> error`` for providers that failed or were skipped."""

    @property
    def culmen(self) -> float | None:
        """culmen's ratio (its speedup over the best peer), ``None`` when it failed or has no peer."""
        return self.ratios.get(CULMEN)


def case_ratios(records: list[Record]) -> dict[str, list[CaseRatios]]:
    """Group ``records`` into ``{family: [CaseRatios, ...]}`` in the order the records came.

    The best peer of a case is the one culmen's record names (the runner leaves informational
    providers out of that choice); without one (culmen failed), the fastest provider other than culmen.
    A case without a timed peer has no ratios (its figure row says why).
    """
    cases: dict[tuple[str, str, str], list[Record]] = {}
    for r in records:
        cases.setdefault((r.family, r.benchmark, r.case), []).append(r)
    out: dict[str, list[CaseRatios]] = {}
    for (family, bench, case), recs in cases.items():
        by = {r.provider: r for r in recs}
        timed = {p: r.ms for p, r in by.items() if r.ms is not None and r.ms > 0 and r.error is None}
        ours = by.get(CULMEN)
        best = ours.best_peer if ours is not None and ours.best_peer in timed else None
        if best is None:
            peers = {p: ms for p, ms in timed.items() if p != CULMEN}
            best = min(peers, key=peers.__getitem__) if peers else None
        row = CaseRatios(bench, case, best)
        for p, r in by.items():
            if p not in timed:
                row.failed[p] = r.error or "no time"
            elif best is not None:
                row.ratios[p] = timed[best] / timed[p]
        out.setdefault(family, []).append(row)
    return out


def load_report(path: str | os.PathLike) -> BenchReport:
    """A ``BenchReport`` from a JSON file written by ``culmen bench --json`` (unknown record keys are
    ignored, so older files load too)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: not a culmen bench JSON report (no 'records' list)")
    names = {f.name for f in fields(Record)}
    records = [Record(**{k: v for k, v in r.items() if k in names}) for r in data["records"]]
    return BenchReport(data.get("metadata") or {}, records)


def family_path(path: str | os.PathLike, family: str) -> Path:
    """``<dir>/<stem>-<family><suffix>`` beside ``path`` (suffix ``.png`` when ``path`` has none)."""
    p = Path(path)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", family) or "family"
    return p.with_name(f"{p.stem}-{safe}{p.suffix or '.png'}")


def _style(provider: str, order: list[str]) -> tuple[str, str]:
    if provider in _PEER_STYLE:
        return _PEER_STYLE[provider]
    others = [p for p in order if p not in _PEER_STYLE]
    return _CYCLE[others.index(provider) % len(_CYCLE)] if provider in others else _CYCLE[0]


def _subtitle(meta: dict[str, Any]) -> str:
    commit = str(meta.get("git_commit") or "-")[:10]
    return (f"{meta.get('gpu', '?')} | {meta.get('date', '?')} | torch {meta.get('torch', '?')} | "
            f"triton {meta.get('triton', '?')} | commit {commit}" + (" | --quick" if meta.get("quick") else ""))


def _xlim(values: list[float]) -> tuple[float, float]:
    lo = min([1.0, *values])
    hi = max([1.0, *values])
    # Symmetric-ish margins on the log axis; never a degenerate one.
    return max(lo / 1.35, 1e-3), min(hi * 1.35, 1e3)


def _rows(groups: list[tuple[str, list[Any]]]) -> tuple[list[tuple[str, bool]], list[list[int]]]:
    """Tick labels top-down (a bold header per group, then its items) and each item's y position."""
    labels: list[tuple[str, bool]] = []
    positions: list[list[int]] = []
    for head, items in groups:
        labels.append((head, True))
        pos = []
        for item in items:
            labels.append((str(item), False))
            pos.append(len(labels))  # 1-based: the tick of this label
        positions.append(pos)
    return labels, positions


def _axes(plt, labels: list[tuple[str, bool]], width: float, lo: float, hi: float):
    fig, ax = plt.subplots(figsize=(width, HEAD_IN + ROW_IN * len(labels)))
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.set_yticks(range(1, len(labels) + 1))
    ax.set_yticklabels([t for t, _ in labels], fontsize=8)
    for tick, (_, bold) in zip(ax.get_yticklabels(), labels):
        if bold:
            tick.set_fontweight("bold")
            tick.set_fontsize(9)
    ax.set_ylim(len(labels) + 0.7, 0.3)
    # Ratios read as plain numbers (0.5x, 2x), not powers of ten.
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = [t for t in (_FINE_TICKS if hi / lo < 12 else _TICKS) if lo <= t <= hi]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3, zorder=0)
    ax.axvline(1.0, color="black", linewidth=1.2, zorder=3)
    return fig, ax


def _bar(ax, y: float, v: float) -> None:
    # From the line at 1.0 to the value: right and green where culmen is faster, left and red where slower.
    ax.barh(y, v - 1.0, left=1.0, height=0.62, color=_WIN if v >= 1.0 else _LOSE, alpha=0.75, zorder=2)


def _note(ax, y: float, text: str, color: str = "black") -> None:
    # A text column right of the axes (x in axes fraction, y in data), clear of every bar and marker.
    ax.text(1.01, y, text, transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=7, color=color,
            clip_on=False)


def _draw_family(plt, family: str, rows: list[CaseRatios], meta: dict[str, Any], path: Path) -> None:
    groups: dict[str, list[CaseRatios]] = {}
    for row in rows:
        groups.setdefault(row.benchmark, []).append(row)
    labels, positions = _rows([(b, [r.case for r in rs]) for b, rs in groups.items()])
    placed = [(y, r) for (_, rs), ys in zip(groups.items(), positions) for y, r in zip(ys, rs)]
    lo, hi = _xlim([v for r in rows for v in r.ratios.values()])
    fig, ax = _axes(plt, labels, WIDTH_IN, lo, hi)
    providers = sorted({p for r in rows for p in (*r.ratios, *r.failed)} - {CULMEN})
    for y, row in placed:
        v = row.culmen
        failed = sorted(p for p in row.failed if p != CULMEN)
        tail = f"  (failed: {', '.join(failed)})" if failed else ""
        if v is None:
            why = row.failed.get(CULMEN, "no culmen record" if row.best_peer else "no peer to compare")
            _note(ax, y, f"culmen: {why[:60]}{tail}", _LOSE)
            continue
        _bar(ax, y, v)
        _note(ax, y, f"{v:.2f}x vs {row.best_peer}{tail}")
    # Peers: a marker each, on the same scale (the best peer of a case sits on the line).
    for prov in providers:
        color, marker = _style(prov, providers)
        pts = [(row.ratios[prov], y) for y, row in placed if prov in row.ratios]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=34, color=color,
                       edgecolors="white", linewidths=0.5, zorder=4, label=prov)
    ax.set_xlabel("speed relative to the best peer of the case (best peer time / provider time, log scale); "
                  ">1: faster than the best peer", fontsize=8)
    from matplotlib.patches import Patch

    handles, names = ax.get_legend_handles_labels()
    handles = [Patch(color=_WIN, alpha=0.75), Patch(color=_LOSE, alpha=0.75), *handles]
    names = ["culmen faster", "culmen slower", *names]
    # Below the axis label, in a strip of its own.
    fig.legend(handles, names, fontsize=7, loc="lower center", ncol=len(names), frameon=False, handlelength=1.2)
    timed = [r.culmen for r in rows if r.culmen is not None]
    head = f"culmen bench: {family} (culmen against the best peer of each case)"
    if timed:
        geo = math.exp(sum(math.log(v) for v in timed) / len(timed))
        head += f": geomean {geo:.2f}x, faster in {sum(v >= 1.0 for v in timed)}/{len(timed)} cases"
    ax.set_title(f"{head}\n{_subtitle(meta)}", fontsize=9, loc="left")
    fig.tight_layout(rect=(0.0, LEGEND_IN / fig.get_figheight(), 1.0, 1.0))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _draw_overview(plt, families: dict[str, list[CaseRatios]], meta: dict[str, Any], path: Path) -> None:
    groups: list[tuple[str, list[str]]] = []
    values: list[list[float]] = []
    for family, rows in families.items():
        benches: dict[str, list[float]] = {}
        for r in rows:
            benches.setdefault(r.benchmark, [])
            if r.culmen is not None:
                benches[r.benchmark].append(r.culmen)
        groups.append((family, list(benches)))
        values.extend(benches.values())
    labels, positions = _rows(groups)
    ys = [y for pos in positions for y in pos]
    lo, hi = _xlim([v for vals in values for v in vals])
    fig, ax = _axes(plt, labels, WIDTH_IN * 0.85, lo, hi)
    for y, vals in zip(ys, values):
        if not vals:
            _note(ax, y, "culmen failed or not compared", _LOSE)
            continue
        geo = math.exp(sum(math.log(v) for v in vals) / len(vals))
        _bar(ax, y, geo)
        ax.plot([min(vals), max(vals)], [y, y], color="black", linewidth=1.0, zorder=4)
        n = len(vals)
        _note(ax, y, f"{geo:.2f}x  ({n} case{'s' if n != 1 else ''}: {min(vals):.2f}-{max(vals):.2f}x)")
    ax.set_xlabel("culmen's speedup over the best peer: geomean over the cases (bar) and their range (line), "
                  "log scale", fontsize=8)
    ax.set_title(f"culmen bench overview (detail: one figure per family beside this one)\n{_subtitle(meta)}",
                 fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def write_plot(report: BenchReport, path: str | os.PathLike, out: TextIO | None = None) -> list[Path]:
    """Draw ``report`` as PNGs: ``<stem>-<family>.png`` per family and the overview at ``path``.

    Returns the paths written (empty, with a message on ``out``, when matplotlib is missing or no
    record has a time).
    """
    out = out or sys.stdout
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot: matplotlib is not installed; not writing {path} (pip install matplotlib)", file=out)
        return []
    families = case_ratios(report.records)
    families = {f: rows for f, rows in families.items() if any(r.ratios for r in rows)}
    if not families:
        print(f"plot: no timed records to draw; not writing {path}", file=out)
        return []
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for family, rows in families.items():
        target = family_path(base, family)
        _draw_family(plt, family, rows, report.metadata, target)
        written.append(target)
    _draw_overview(plt, families, report.metadata, base)
    written.append(base)
    for p in written:
        print(f"plot written to {p}", file=out)
    return written
