"""chart.py - the benchmark's picture: every figure that has a limit, as its ratio to that limit
(a horizontal bar, log scale), with its target as a black mark on the bar; green when the
target is met, red when it is missed, grey when the figure has no target. Drawn with gnuplot
(tests/harness/idem_harness.py: gnuplot) into an SVG beside latest.md.

    chart.draw(doc, "bench/results/latest.svg")   # doc: the contents of latest.json
    /usr/bin/python3 bench/bench.py --chart bench/results/latest.json
"""

import re

import idem_harness as H

GREEN, RED, GREY = "#2ca02c", "#d62728", "#9e9e9e"


def target_ratio(target, base):
    """A row's target in ratio units: '>= 0.8x' is 0.8; '<= 2 ms' against a base of 4 ms is
    0.5; None without a target or a base."""
    m = re.match(r"\s*(<=|>=|<|>)\s*([\d.,]+)\s*(x)?", target or "")
    if not m:
        return None
    num = float(m.group(2).replace(",", ""))
    if m.group(3) == "x":
        return num
    return num / base if base else None


def _num(v, unit):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return "n/a"
    if unit in ("msg/s", "events/s"):
        return f"{v:,.0f} {unit}"
    if unit == "%":
        return f"{v:.2f} %"
    if unit == "MiB":
        return f"{v:.1f} MiB"
    if unit == "ms":
        return f"{v:.2f} ms"
    return f"{v:g} {unit}"


def _dq(text):
    """A gnuplot double-quoted string ("\\n" is a line break)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def bars(doc):
    """[(label, ratio, target ratio or None, colour, bar text)] of the rows with a ratio."""
    out = []
    for r in doc.get("rows", []):
        ratio = r.get("ratio")
        if ratio is None:
            continue
        tr = r.get("target_ratio")
        if tr is None:
            tr = target_ratio(r.get("target"), r.get("base"))
        judged = r.get("judged") and r.get("pass") is not None
        colour = (GREEN if r["pass"] else RED) if judged else GREY
        value, base = _num(r["value"], r["unit"]), _num(r["base"], r["base_unit"])
        if r["compared_with"] == "target":
            label = f"{r['figure']}\n{value}, target {r['target']}"
        else:
            label = (f"{r['figure']}\nvs {r['compared_with']}\n{value} vs {base}"
                     + (f", target {r['target']}" if r.get("target") else ""))
        text = f"{ratio:.2f}x" + ("" if not judged else ("" if r["pass"] else "  missed"))
        out.append((label, float(ratio), tr, colour, text))
    return out


def script(doc, svg):
    rows = bars(doc)
    meta = doc.get("meta", {})
    n = len(rows)
    hi = max([r[1] for r in rows] + [r[2] or 0 for r in rows] + [2.0]) * 3
    positive = [v for r in rows for v in r[1:3] if v]
    lo = max(0.01, min(positive + [0.5]) / 2)  # log scale: a ratio of 0 draws no bar
    height = 150 + 54 * n
    lines = [
        f"set terminal svg size 1150,{height} dynamic noenhanced font 'Helvetica,11' "
        "background rgb 'white'",
        f"set output {H.gp_str(svg)}",
        "set datafile separator '\\t'",
        "$D << EOD",
    ]
    for i, (label, ratio, tr, colour, text) in enumerate(rows, 1):
        tr_s = "NaN" if tr is None else f"{tr:.6g}"
        at = max(ratio, tr or 0) * 1.1  # the bar's text, right of the bar and the mark
        lines.append(f"{i}\t{ratio:.6g}\t{tr_s}\t0x{colour[1:]}\t{text}\t{at:.6g}")
    lines.append("EOD")
    # the rows' names, left of the plot (labels, not tic labels: those are format strings)
    for i, r in enumerate(rows, 1):
        lines.append(f"set label {i} {_dq(r[0])} at graph -0.015, first {i} right font ',10'")
    lines += [
        "set title " + H.gp_str(f"idem benchmark, {meta.get('date', '')}: each figure as a "
                                "ratio to its limit or target (log scale)"),
        "set logscale x 10",
        f"set xrange [{lo:.3g}:{hi:.3g}]",
        f"set yrange [{n + 0.7}:0.3]",
        "unset ytics",
        "set xtics (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) nomirror",
        "set mxtics 10",
        "set grid xtics lc rgb '#e5e5e5'",
        "set border 1",
        "set xlabel 'idem / limit  (bar: green = target met, red = missed, grey = no target; "
        "black mark: the target; dashed: 1x)'",
        "set key off",
        "set style textbox opaque noborder margins 1,1",
        "set lmargin 44",
        "set arrow 1 from 1, graph 0 to 1, graph 1 nohead dt 2 lc rgb '#555555' back",
        f"plot $D using ({lo:.3g}):1:({lo:.3g}):2:($1-0.32):($1+0.32):4 with boxxyerror "
        "fs solid 0.85 noborder lc rgb variable, \\",
        "     $D using 3:($1-0.42):(0):(0.84) with vectors nohead lw 3.5 lc rgb 'black', \\",
        "     $D using 6:1:5:4 with labels left boxed tc rgb variable font ',10'",
    ]
    return "\n".join(lines) + "\n"


def draw(doc, svg):
    """Writes svg (RuntimeError when gnuplot is missing or fails); returns its path."""
    H.gnuplot(script(doc, svg))
    return svg
