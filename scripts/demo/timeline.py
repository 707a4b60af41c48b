"""The demo's timeline: pending, published and consumed events sampled during the run, and a
marker at every injected fault, drawn as an SVG with gnuplot (tests/harness: gnuplot, gp_str).

    tl = Timeline()
    tl.sample(t, emitted=..., pending=..., published=..., consumed=..., outbox=...)
    tl.mark(t, "kill", "SIGKILL relay1")
    svg = tl.draw(out_dir, title)      # out_dir/timeline.{dat,gp,svg}
"""

import os

import idem_harness as H

# Marker kinds: (colour, dash type, legend title). Faults first, then the run's milestones.
KINDS = {
    "kill": ("#d62728", 2, "SIGKILL"),
    "restart": ("#1f77b4", 4, "restart with IDEM_FAULT armed"),
    "crash": ("#9467bd", 1, "crash at a fault seam (then restarted)"),
    "exit": ("#8c564b", 1, "unplanned exit (then restarted)"),
    "milestone": ("#7f7f7f", 3, "workload milestone"),
}
COLUMNS = ("t", "emitted", "pending", "published", "consumed", "outbox")


class Timeline:
    def __init__(self):
        self.samples = []  # (t, emitted, pending, published, consumed, outbox)
        self.markers = []  # (t, kind, label)

    def sample(self, t, emitted, pending, published, consumed, outbox):
        self.samples.append((round(t, 2), emitted, pending, published, consumed, outbox))

    def mark(self, t, kind, label):
        assert kind in KINDS, kind
        self.markers.append((round(t, 2), kind, label))

    def count(self, kind):
        return sum(1 for m in self.markers if m[1] == kind)

    def write_data(self, path):
        with open(path, "w") as f:
            f.write("# " + "\t".join(COLUMNS) + "\n")
            for row in self.samples:
                f.write("\t".join(str(v) for v in row) + "\n")
            f.write("\n\n# markers: t\tkind\tlabel\n")
            for t, kind, label in self.markers:
                f.write(f"# {t}\t{kind}\t{label}\n")

    def script(self, data, svg, title):
        t_end = max([s[0] for s in self.samples] + [m[0] for m in self.markers] + [1.0])
        top = max([s[3] for s in self.samples] + [s[5] for s in self.samples] + [10])
        lines = [
            "set terminal svg size 1000,560 dynamic noenhanced font 'Helvetica,12' "
            "background rgb 'white'",
            f"set output {H.gp_str(svg)}",
            "set datafile separator '\\t'",
            f"set title {H.gp_str(title)}",
            "set xlabel 'seconds since the workload started'",
            "set ylabel 'events published / consumed (cumulative)'",
            "set y2label 'pending outbox rows'",
            "set ytics nomirror",
            "set y2tics",
            "set format y '%.0f'",
            "set grid xtics ytics lc rgb '#e5e5e5'",
            "set bmargin 8",
            "set key at screen 0.5, screen 0.02 center bottom horizontal maxrows 3 samplen 3 "
            "width 2",
            f"set xrange [0:{t_end * 1.02 + 0.5:.1f}]",
            # room above the curves for the markers' labels
            f"set yrange [0:{top * 1.45:.0f}]",
            "set y2range [0:*]",
            "set border 3",
            "set xtics nomirror",
        ]
        for i, (t, kind, label) in enumerate(self.markers):
            colour, dash, _ = KINDS[kind]
            lines.append(f"set arrow {i + 1} from {t}, graph 0 to {t}, graph 1 nohead "
                         f"lc rgb '{colour}' dt {dash} lw 1.5 front")
            lines.append(f"set label {i + 1} {H.gp_str(label)} at {t}, graph 0.99 rotate by 90 "
                         f"right offset -1,0 tc rgb '{colour}' font ',10' front")
        d = H.gp_str(data)
        plots = [
            f"{d} using 1:3 axes x1y2 with filledcurves x1 fc rgb '#ff7f0e' "
            "fs transparent solid 0.35 noborder title 'pending (right axis)'",
            f"{d} using 1:4 with lines lw 3 lc rgb '#1f77b4' title 'published (outbox rows sent)'",
            f"{d} using 1:5 with lines lw 2 dt 2 lc rgb '#2ca02c' "
            "title 'consumed (ledger rows)'",
        ]
        kinds = {m[1] for m in self.markers}
        for kind in KINDS:
            if kind in kinds:
                colour, dash, name = KINDS[kind]
                plots.append(f"NaN with lines lc rgb '{colour}' dt {dash} lw 1.5 "
                             f"title {H.gp_str(name)}")
        lines.append("plot " + ", \\\n     ".join(plots))
        return "\n".join(lines) + "\n"

    def draw(self, out_dir, title):
        """Writes out_dir/timeline.dat, timeline.gp and timeline.svg; returns the SVG's path.
        Raises RuntimeError when gnuplot is missing or fails (the data and script stay)."""
        os.makedirs(out_dir, exist_ok=True)
        data = os.path.join(out_dir, "timeline.dat")
        svg = os.path.join(out_dir, "timeline.svg")
        gp = os.path.join(out_dir, "timeline.gp")
        self.write_data(data)
        with open(gp, "w") as f:
            f.write(self.script("timeline.dat", "timeline.svg", title))
        with open(gp) as f:
            H.gnuplot(f.read(), cwd=out_dir)
        return svg
