"""Every eviction policy on Mooncake-format traces at 1, 5, 25 and 50 % of the distinct pages.

For each trace, page size 1 (one token per 512-token block, `--ids-as-tokens`) and page size 16
(the trace's real lengths), runs `strata sim --device P% --eviction all` and prints a Markdown
table of hit rates (% of prompt tokens), Belady's bound, the default (`auto`) against the best
other policy, its share of Belady, its replay speed against LRU's in the same run and its
metadata per cached token; `--plot` writes an SVG per trace and page size.

python3 scripts/eviction_table.py STRATA TRACE [TRACE ...] [--plot-dir DIR]

Standard library only. Traces: ../shared/traces/mooncake_synthetic_trace.jsonl (shipped) and
Mooncake's FAST'25 conversation trace (docs/BENCHMARKS.md says how to fetch it).
"""

import argparse
import os
import subprocess

CAPS = [1, 5, 25, 50]
POLICIES = ["lru", "gdsf", "sieve", "s3fifo", "auto"]


def run(strata, trace, page, cap):
    args = [strata, "sim", "--trace", trace, "--device", f"{cap}%", "--eviction", "all"]
    args += ["--page-size", "1", "--ids-as-tokens"] if page == 1 else ["--page-size", "16"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if f and f[0] in POLICIES and len(f) >= 11:
            rows[f[0]] = {"hit": float(f[4]), "rps": float(f[7]), "meta": float(f[10])}
        if f and f[0] == "belady":
            rows["belady"] = {"hit": float(f[1])}
    return rows


def svg(title, table):
    W, H, L, R, T, B = 560, 320, 50, 110, 30, 40
    ymax = max(r["belady"]["hit"] for r in table.values()) * 1.05 or 1
    xs = {c: L + (W - L - R) * i / (len(CAPS) - 1) for i, c in enumerate(CAPS)}
    Y = lambda v: T + (H - T - B) * (1 - v / ymax)
    colors = dict(zip(POLICIES + ["belady"],
                      ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#000000", "#888888"]))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11"><rect width="{W}" height="{H}" fill="#fff"/>',
           f'<text x="{L}" y="16" font-size="13">{title}</text>']
    for k in range(5):
        v = ymax / 1.05 * k / 4
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#ddd"/>'
                   f'<text x="6" y="{Y(v) + 4:.1f}">{v:.0f} %</text>')
    for c, x in xs.items():
        out.append(f'<text x="{x:.1f}" y="{H - 20}" text-anchor="middle">{c} %</text>')
    out.append(f'<text x="{L}" y="{H - 4}">device capacity (% of distinct pages); hit % of '
               f'prompt tokens</text>')
    for i, p in enumerate(POLICIES + ["belady"]):
        col, width = colors[p], 3 if p == "auto" else 1.5
        dash = ' stroke-dasharray="5 3"' if p == "belady" else ""
        d = " ".join(f"{'L' if j else 'M'}{xs[c]:.1f} {Y(table[c][p]['hit']):.1f}"
                     for j, c in enumerate(CAPS))
        out.append(f'<path d="{d}" fill="none" stroke="{col}" stroke-width="{width}"{dash}/>')
        ly = T + 14 * i
        out.append(f'<line x1="{W - R + 10}" x2="{W - R + 30}" y1="{ly}" y2="{ly}" '
                   f'stroke="{col}" stroke-width="{width}"{dash}/>'
                   f'<text x="{W - R + 34}" y="{ly + 4}">{p}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("strata")
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--plot-dir", default=None)
    a = ap.parse_args()
    print("| trace | page | capacity | LRU | GDSF | SIEVE | S3-FIFO | **auto** | Belady "
          "| auto − best other | auto / Belady | auto speed / LRU | auto meta B/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = None
    for trace in a.traces:
        name = os.path.basename(trace).removesuffix(".jsonl")
        for page in (1, 16):
            table = {c: run(a.strata, trace, page, c) for c in CAPS}
            for c in CAPS:
                r = table[c]
                best = max(r[p]["hit"] for p in POLICIES if p != "auto")
                gap = r["auto"]["hit"] - best
                worst = gap if worst is None else min(worst, gap)
                cells = " | ".join(f"{r[p]['hit']:.2f}" for p in POLICIES[:-1])
                print(f"| {name} | {page} | {c} % | {cells} | **{r['auto']['hit']:.2f}** | "
                      f"{r['belady']['hit']:.2f} | {gap:+.2f} | "
                      f"{100 * r['auto']['hit'] / r['belady']['hit']:.1f} % | "
                      f"{r['auto']['rps'] / r['lru']['rps']:.2f} | {r['auto']['meta']:.2f} |")
            if a.plot_dir:
                os.makedirs(a.plot_dir, exist_ok=True)
                path = os.path.join(a.plot_dir, f"eviction-{name}-page{page}.svg")
                open(path, "w").write(svg(f"{name}, page {page}", table))
    print(f"\nworst auto − best other policy: {worst:+.2f} points")


if __name__ == "__main__":
    main()
