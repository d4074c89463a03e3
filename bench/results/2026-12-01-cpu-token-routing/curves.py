"""The record's tables from score files (python curves.py scores.txt scores_none_s2.txt): faces FD at each checkpoint with its
training seconds, per run; and for each seed (and the seeds' mean curves), the wall-clock and the steps the routed
run needs to reach the plain run's final FD, over the plain run's (first crossing, straight between points)."""

import re
import sys
from collections import defaultdict

runs = defaultdict(list)  # name -> [(steps, seconds, FD)]
for path in sys.argv[1:] or ["scores.txt", "scores_none_s2.txt"]:
    for line in open(path):
        m = re.match(r"(\S+) steps (\d+) .* at_s=(\d+) .*faces FD ([\d.]+)", line)
        if m:
            runs[m[1]].append((int(m[2]), int(m[3]), float(m[4])))


def crossing(points, target, axis):
    """The first `axis` value (0 steps, 1 seconds) at which the curve through `points` reaches `target` or None."""
    prev = None
    for p in points:
        if p[2] <= target:
            if prev is None:
                return p[axis]
            f = (prev[2] - target) / (prev[2] - p[2])
            return prev[axis] + f * (p[axis] - prev[axis])
        prev = p
    return None


print("| run | " + " | ".join(f"{s} steps" for s, _, _ in runs[next(iter(runs))]) + " |")
for name, points in runs.items():
    print(f"| {name} | " + " | ".join(f"{fd:.2f} ({sec} s)" for _, sec, fd in points) + " |")
print()
pairs = [(f"seed {s}", runs.get(f"fc_routed_s{s}"), runs.get(f"fc_none_s{s}")) for s in (1, 2)]
if all(r and n and len(r) == len(n) for _, r, n in pairs):
    mean = lambda a, b: [(x[0], (x[1] + y[1]) / 2, (x[2] + y[2]) / 2) for x, y in zip(a, b)]  # noqa: E731
    pairs.append(("mean curves", mean(pairs[0][1], pairs[1][1]), mean(pairs[0][2], pairs[1][2])))
for label, routed, plain in pairs:
    if not routed or not plain or len(routed) < 5 or len(plain) < 5:
        print(f"{label}: not complete")
        continue
    target = plain[-1][2]
    words = []
    for axis, what in ((1, "wall-clock"), (0, "steps")):
        at = crossing(routed, target, axis)
        words.append(f"{what} {at / plain[-1][axis]:.2f}x" if at is not None else f"{what}: not reached")
    print(f"{label}: plain final FD {target:.2f} in {plain[-1][1]} s; routed reaches it at " + ", ".join(words)
          + f"; routed final FD {routed[-1][2]:.2f} in {routed[-1][1]:.0f} s")
print()
for s in (1, 2):
    m, a = runs.get(f"fc1x_muon_s{s}"), runs.get(f"fc1x_adamw_s{s}")
    if m and a and len(m) == len(a) == 2:
        print(f"seed {s}, bare budget (640 steps): muon FD {m[0][2]:.2f} / {m[1][2]:.2f} at 320 / 640 steps "
              f"({m[1][1]} s), adamw {a[0][2]:.2f} / {a[1][2]:.2f} ({a[1][1]} s)")
