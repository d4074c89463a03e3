"""Curves and crossings from a record's scores (python curves.py DIR CANDIDATE BASELINE): each run's score at each
checkpoint with its training seconds (DIR/scores.txt's at_s; faces FD from the line, or class match and photos FD
from DIR/NAME-atSTEPS.json), then for each seed the seconds and the steps CANDIDATE_sN needs to reach BASELINE_sN's
final FD, over BASELINE_sN's (the first crossing, straight between scored points). 2026-12-02-cpu-muon-small and
2026-12-02-cpu-muon-4x read it too."""

import json
import re
import sys
from pathlib import Path

where, candidate, baseline = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = {}  # name -> [(steps, seconds, FD, match % or None)]
for line in (where / "scores.txt").read_text().splitlines():
    m = re.match(r"(\S+) steps (\d+) (?:\(.*?\) )?at_s=(\d+) .*\| (.*)", line)
    if not m:
        continue
    fd = re.search(r"faces FD ([\d.]+)", m[4])
    if fd:
        point = (float(fd[1]), None)
    else:
        score = json.loads((where / f"{m[1]}-at{m[2]}.json").read_text())
        point = (score["fd"], 100 * score["match"])
    runs.setdefault(m[1], []).append((int(m[2]), int(m[3])) + point)


def crossing(points, target, axis):
    """The first `axis` value (0 steps, 1 seconds) at which the FD curve through `points` reaches `target`, or None."""
    prev = None
    for p in points:
        if p[2] <= target:
            if prev is None:
                return p[axis]
            return prev[axis] + (prev[2] - target) / (prev[2] - p[2]) * (p[axis] - prev[axis])
        prev = p
    return None


for name, points in sorted(runs.items()):
    cells = [f"{fd:.2f}" + (f" / {match:.1f}%" if match is not None else "") + f" ({s} s)" for _, s, fd, match in points]
    print(f"| {name} | " + " | ".join(cells) + " |")
print()
for seed in (1, 2):
    cand, base = runs.get(f"{candidate}_s{seed}"), runs.get(f"{baseline}_s{seed}")
    if not cand or not base or len(cand) < 4 or len(base) < 4:
        print(f"seed {seed}: not complete")
        continue
    target, words = base[-1][2], []
    for axis, what in ((1, "wall-clock"), (0, "steps")):
        at = crossing(cand, target, axis)
        words.append(f"{what} {at / base[-1][axis]:.2f}x" if at is not None else f"{what}: not reached")
    print(f"seed {seed}: {baseline} final FD {target:.2f} at {base[-1][1]} s; {candidate} reaches it at "
          + ", ".join(words) + f"; {candidate} final FD {cand[-1][2]:.2f} at {cand[-1][1]} s"
          + f" (s/step {cand[-1][1] / cand[-1][0]:.3f} against {base[-1][1] / base[-1][0]:.3f})")
