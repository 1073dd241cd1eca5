"""How close a worker's live miss-ratio curve is to `strata sim` on the traffic it served.

Starts `strata serve` with `--record-trace`, replays a Mooncake trace through it with
`strata bench workload --workload trace --closed-loop --concurrency 1`, reads the worker's
`GET /cache/curve`, and for every point of the device and host tiers replays the recorded trace
with `strata sim` (the worker's eviction policy, one tier of the point's size, the worker's page
size): a Markdown table of both hit rates and Belady's bounds, and the mean absolute error in
points. `--serve-arg=--eviction=lru` measures the LRU curve (sampled reuse distances over all
traffic) instead of the default's (a miniature simulation over the recent window).

python3 scripts/curve_accuracy.py STRATA TRACE [--length-scale 0.03125] [--limit 1000]
    [--hicache-size 900MiB] [--device-mem 256MiB] [--out DIR]

Standard library only.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request


def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def serve(a, out):
    rec = os.path.join(out, "recorded.jsonl")
    log = open(os.path.join(out, "serve.log"), "w")
    p = subprocess.Popen(
        [a.strata, "serve", "--port", "0", "--page-size", "16", "--device-mem", a.device_mem,
         "--hicache-size", a.hicache_size, "--record-trace", rec] + a.serve_arg,
        stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        time.sleep(0.5)
        text = open(os.path.join(out, "serve.log")).read()
        m = re.search(r"ready on http://([0-9.:]+)", text)
        if m:
            return p, "http://" + m.group(1), rec
        if p.poll() is not None:
            sys.exit("strata serve exited:\n" + text)
    sys.exit("strata serve never became ready")


def sim(a, rec, tokens, policy):
    out = subprocess.run(
        [a.strata, "sim", "--trace", rec, "--block-tokens", "16", "--page-size", "16",
         "--eviction", policy, "--device", str(tokens), "--plot", os.devnull],
        capture_output=True, text=True, check=True).stdout
    lru = belady = None
    for line in out.splitlines():
        f = line.split()
        if f[:1] == [policy]:
            lru = float(f[4])
        if f[:1] == ["belady"]:
            belady = float(f[1])
    return lru, belady


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("strata")
    ap.add_argument("trace")
    ap.add_argument("--length-scale", default="0.03125")
    ap.add_argument("--limit", default="1000")
    ap.add_argument("--hicache-size", default="900MiB")
    ap.add_argument("--device-mem", default="256MiB")
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="write an SVG of both curves here")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="curve-accuracy-")
    os.makedirs(out, exist_ok=True)
    p, url, rec = serve(a, out)
    try:
        subprocess.run(
            [a.strata, "bench", "workload", "--url", url, "--workload", "trace",
             "--trace", a.trace, "--length-scale", a.length_scale, "--limit", a.limit,
             "--closed-loop", "--concurrency", "1", "--max-tokens", "1",
             "--json", os.path.join(out, "bench.json")],
            check=True, stdout=subprocess.DEVNULL)
        refs = get(url + "/cache/curve")["references"]
        # Belady's bound comes from the background simulations: wait until they saw it all.
        for _ in range(240):
            c = get(url + "/cache/curve")
            if c["window_references"] > 0 and c["references"] == refs and all(
                    p["belady"] is not None for p in c["points"]):
                time.sleep(2)
                c = get(url + "/cache/curve")
                break
            time.sleep(0.5)
        advice = subprocess.run([a.strata, "plan", "--advise-from", url],
                                capture_output=True, text=True, check=True).stdout
    finally:
        p.terminate()
        p.wait()
    json.dump(c, open(os.path.join(out, "curve.json"), "w"), indent=1)
    lines = sum(1 for _ in open(rec))
    print(f"recorded {lines} requests in {rec}; policy {c['policy']}, sample rate "
          f"{c['sample_rate']:.4f}, {c['references']} prompt pages observed")
    print("| tier | scale | pages | live hit % | strata sim hit % | error (points) "
          "| live Belady % | strata sim Belady % |")
    print("|---|---|---|---|---|---|---|---|")
    errs, rows = [], []
    for pt in c["points"]:
        if pt["tier"] not in ("device", "host") or pt["pages"] == 0:
            continue
        lru, belady = sim(a, rec, pt["pages"] * 16, c["policy"])
        live = 100 * pt["hit_ratio"]
        errs.append(abs(live - lru))
        rows.append((pt["tier"], pt["pages"], live, lru))
        lb = "-" if pt["belady"] is None else f"{100 * pt['belady']:.2f}"
        print(f"| {pt['tier']} | {pt['scale']} | {pt['pages']} | {live:.2f} | {lru:.2f} | "
              f"{live - lru:+.2f} | {lb} | {belady:.2f} |")
    print(f"mean absolute error: {sum(errs) / len(errs):.2f} points over {len(errs)} sizes "
          f"(max {max(errs):.2f})")
    print("\nstrata plan --advise-from the live worker:")
    print("\n".join(l for l in advice.splitlines() if l.startswith(("advice", "answer"))))
    dev = next(pt["pages"] for pt in c["points"] if pt["tier"] == "device" and pt["scale"] == 1)
    fractions = ",".join(f"{k / 40:g}" for k in range(1, 41))
    sim_advice = subprocess.run(
        [a.strata, "sim", "--trace", rec, "--block-tokens", "16", "--page-size", "16",
         "--eviction", c["policy"], "--device", str(dev * 16), "--advise", "--fractions", fractions,
         "--plot", os.path.join(out, "sim-advise.svg")],
        capture_output=True, text=True, check=True).stdout
    print("strata sim --advise on the recorded trace (the same device tier):")
    print("\n".join(l for l in sim_advice.splitlines() if l.startswith(("advice", "knee"))))
    if a.plot:
        open(a.plot, "w").write(svg(rows))
        print(f"plot written to {a.plot}")


def svg(rows):
    """Hit % against cache pages (log scale): the live curve and strata sim's, per tier."""
    import math
    W, H, L, R, T, B = 640, 360, 50, 150, 20, 40
    xs = [math.log2(r[1]) for r in rows]
    x0, x1 = min(xs), max(xs)
    ymax = max(max(r[2], r[3]) for r in rows) * 1.1 or 1
    X = lambda p: L + (W - L - R) * (math.log2(p) - x0) / max(1e-9, x1 - x0)
    Y = lambda v: T + (H - T - B) * (1 - v / ymax)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11"><rect width="{W}" height="{H}" fill="#fff"/>']
    for k in range(5):
        v = ymax / 1.1 * k / 4
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#ddd"/>'
                   f'<text x="4" y="{Y(v) + 4:.1f}">{v:.1f}</text>')
    out.append(f'<text x="{L}" y="{H - 8}">cache pages (log scale); hit % of prompt tokens</text>')
    colors = {("device", 0): "#0969da", ("device", 1): "#8ab4f8",
              ("host", 0): "#cf222e", ("host", 1): "#f4a3a8"}
    for tier in ("device", "host"):
        pts = sorted((r for r in rows if r[0] == tier), key=lambda r: r[1])
        for k, name in ((0, "live curve"), (1, "strata sim")):
            col = colors[(tier, k)]
            d = " ".join(f"{'L' if i else 'M'}{X(r[1]):.1f} {Y(r[2 + k]):.1f}"
                         for i, r in enumerate(pts))
            dash = ' stroke-dasharray="5 3"' if k else ""
            out.append(f'<path d="{d}" fill="none" stroke="{col}" stroke-width="2"{dash}/>')
            for r in pts:
                out.append(f'<circle cx="{X(r[1]):.1f}" cy="{Y(r[2 + k]):.1f}" r="3" fill="{col}"/>')
            ly = T + 16 * (2 * ("device", "host").index(tier) + k)
            out.append(f'<line x1="{W - R + 10}" x2="{W - R + 30}" y1="{ly}" y2="{ly}" '
                       f'stroke="{col}" stroke-width="2"{dash}/>'
                       f'<text x="{W - R + 34}" y="{ly + 4}">{tier}: {name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
