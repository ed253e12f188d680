#!/usr/bin/env python3
"""Where a graph-replayed step's time goes, from tools/gpu-lab/kernel_trace.c's records.

  python3 tools/gpu-lab/trace_step.py /tmp/k.tsv [--min-replays 5] [--graph ID]

For each captured graph replayed at least --min-replays times, the replays are cut out of
the trace (one kernel per graph node each) and, per kernel name, summed over the step:
- `own`: the kernel's own span (end - start), which with programmatic launch includes the
  time its blocks sat at griddepcontrol.wait;
- `adds`: how much it moves the step's end: its end minus the latest end before it. Over a
  replay these sum to the replay's span (first start to last end), so they say where the
  step's time goes with the kernels overlapping as they ran.
Medians over the replays. Also the span, and the gap from one replay's last end to the
next one's first start (what runs between two forward passes), with what ran in it
outside any graph (kernels, and copies when the trace has them: `memcpy_<kind>_<bytes>`,
kind 1 host to device, 2 device to host) and how much of it nothing ran; and the most
common gap's items in order, each with its start and end after the replay's last end.
"""
import argparse
import statistics as st
from collections import defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--min-replays", type=int, default=5)
ap.add_argument("--graph", type=int)
a = ap.parse_args()

rows = []
for line in open(a.trace):
    f = line.rstrip("\n").split("\t")
    if len(f) < 8:
        continue
    rows.append((int(f[0]), int(f[1]), int(f[2]), int(f[3]), f[5], f[6], f[7]))

by_graph = defaultdict(list)
for r in rows:
    if r[2]:
        by_graph[r[2]].append(r)


def short(name):
    return name if len(name) <= 58 else name[:55] + "..."


print(f"{len(rows)} kernels, {len(by_graph)} graphs")
for gid, rs in sorted(by_graph.items()):
    if a.graph is not None and gid != a.graph:
        continue
    nodes = {r[3] for r in rs}
    n = len(nodes)
    rs.sort(key=lambda r: r[0])
    replays = [rs[i:i + n] for i in range(0, len(rs) - n + 1, n)]
    replays = [p for p in replays if {r[3] for r in p} == nodes]
    if len(replays) < a.min_replays:
        continue
    spans = [max(r[1] for r in p) - p[0][0] for p in replays]
    gaps = [replays[i + 1][0][0] - max(r[1] for r in replays[i]) for i in range(len(replays) - 1)]
    periods = [replays[i + 1][0][0] - replays[i][0][0] for i in range(len(replays) - 1)]
    own = defaultdict(list)
    adds = defaultdict(list)
    lags = defaultdict(list)
    count = defaultdict(int)
    grids = {}
    for k, p in enumerate(replays):
        p = sorted(p, key=lambda r: r[0])
        o = defaultdict(int)
        ad = defaultdict(int)
        lg = defaultdict(int)
        latest = p[0][0]
        prev_end = None
        for r in p:
            o[r[6]] += r[1] - r[0]
            ad[r[6]] += max(0, r[1] - latest)
            if prev_end is not None:
                lg[r[6]] += r[0] - prev_end
            latest = max(latest, r[1])
            prev_end = r[1]
            if k == 0:
                count[r[6]] += 1
                grids[r[6]] = (r[4], r[5])
        for name in o:
            own[name].append(o[name])
            adds[name].append(ad[name])
            lags[name].append(lg[name])
    med = lambda xs: st.median(xs) / 1000.0
    print(f"\ngraph {gid}: {n} kernels, {len(replays)} replays; span median {med(spans):.1f} us "
          f"(min {min(spans)/1000:.1f}, max {max(spans)/1000:.1f}); "
          f"gap to next replay median {med(gaps) if gaps else 0:.1f} us; "
          f"period median {med(periods) if periods else 0:.1f} us")
    print(f"{'kernel':58} {'n':>4} {'adds us':>9} {'own us':>9} {'adds/n':>7} {'own/n':>7} "
          f"{'start-prev.end/n':>16}  grid block")
    for name in sorted(adds, key=lambda x: -st.median(adds[x])):
        c = count[name]
        print(f"{short(name):58} {c:4} {med(adds[name]):9.1f} {med(own[name]):9.1f} "
              f"{med(adds[name])/c:7.2f} {med(own[name])/c:7.2f} {med(lags[name])/c:16.2f}  "
              f"{grids[name][0]} {grids[name][1]}")
    # The gaps: what ran in them outside any graph, and the time nothing ran.
    loose = sorted((r for r in rows if not r[2]), key=lambda r: r[0])
    in_gap = defaultdict(list)
    per_gap = []
    idle = []
    shapes = defaultdict(list)  # the gap's items by name in order -> (offsets, next start) per gap
    for i in range(len(replays) - 1):
        lo, hi = max(r[1] for r in replays[i]), min(r[0] for r in replays[i + 1])
        items = [r for r in loose if lo <= r[0] < hi]
        shapes[tuple(r[6] for r in items)].append(([(r[0] - lo, r[1] - lo) for r in items], hi - lo))
        busy, at = 0, lo
        for r in items:
            busy += max(0, min(r[1], hi) - max(r[0], at))
            at = max(at, r[1])
        idle.append(hi - lo - busy)
        c = defaultdict(int)
        for r in items:
            c[r[6]] += 1
            in_gap[r[6]].append(r[1] - r[0])
        per_gap.append(c)
    if idle:
        print(f"gaps: nothing running {med(idle):.1f} us of the median gap; outside any graph:")
        for name in sorted(in_gap, key=lambda x: -sum(in_gap[x])):
            print(f"  {short(name):58} per gap {st.median(c[name] for c in per_gap):4.1f}  each {med(in_gap[name]):7.2f} us")
        # The most common gap, in order: each item's start and end after the replay's last
        # end (medians), so the idle time shows between which two things it falls.
        names, gs = max(shapes.items(), key=lambda kv: len(kv[1]))
        print(f"the most common gap ({len(gs)} of {len(idle)}), from the replay's end, medians:")
        for j, name in enumerate(names):
            s0, e0 = med([g[0][j][0] for g in gs]), med([g[0][j][1] for g in gs])
            print(f"  {s0:7.2f} .. {e0:7.2f} us  {short(name)}")
        print(f"  {med([g[1] for g in gs]):7.2f} us  the next replay's first kernel starts")
