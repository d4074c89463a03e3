"""The record's tables (python curves.py [SCORES_DIR]): each labelled run's class match and photos FD at each scored
checkpoint with its training seconds (SCORES_DIR/scores.txt's at_s, SCORES_DIR/NAME-atSTEPS.json's scores; this
folder's copies by default), and for each seed the seconds and steps Muon and the routed run need to reach the
default's final FD at the bare budget, over the default's (first crossing, straight between scored points).
Seed 2's default at the bare budget is the 2026-11-29-cpu-loss-curves record's ld_none_s2 (its end alone; this
protocol is deterministic: seed 1 reproduced that record's ld_none_s1 to the digit), timed by seed 1's."""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

here = Path(__file__).parent
where = Path(sys.argv[1]) if len(sys.argv) > 1 else here
runs = defaultdict(list)  # name -> [(steps, seconds, match %, FD)]
for line in (where / "scores.txt").read_text().splitlines():
    m = re.match(r"(\S+) steps (\d+) .* at_s=(\d+) ", line)
    if m:
        score = json.loads((where / f"{m[1]}-at{m[2]}.json").read_text())
        runs[m[1]].append((int(m[2]), int(m[3]), 100 * score["match"], score["fd"]))
old = json.loads((here.parent / "2026-11-29-cpu-loss-curves" / "ld_none_s2-gen.json").read_text())
if "lb1x_adamw_s1" in runs:
    runs["lb1x_adamw_s2"] = [(1536, runs["lb1x_adamw_s1"][-1][1], 100 * old["match"], old["fd"])]


def crossing(points, target, axis):
    """The first `axis` value (0 steps, 1 seconds) at which the FD curve through `points` reaches `target`, or None."""
    prev = None
    for p in points:
        if p[3] <= target:
            if prev is None:
                return p[axis]
            f = (prev[3] - target) / (prev[3] - p[3])
            return prev[axis] + f * (p[axis] - prev[axis])
        prev = p
    return None


print("| run | " + " | ".join(["checkpoints: steps, training s, class match %, photos FD"]) + " |")
for name, points in sorted(runs.items()):
    print(f"| {name} | " + " ; ".join(f"{s}: {sec} s, {m:.1f}%, FD {fd:.2f}" for s, sec, m, fd in points) + " |")
print()
for lever in ("muon", "routed"):
    for seed in (1, 2):
        run, base = runs.get(f"lb1x_{lever}_s{seed}"), runs.get(f"lb1x_adamw_s{seed}")
        if not run or not base or len(run) < 2:
            print(f"{lever}, seed {seed}: not complete")
            continue
        target, end = base[-1][3], base[-1]
        words = []
        for axis, what in ((1, "seconds"), (0, "steps")):
            at = crossing(run, target, axis)
            words.append(f"{what} {at / end[axis]:.2f}x" if at is not None else f"{what}: not reached")
        print(f"{lever}, seed {seed}: default's final FD {target:.2f} ({end[2]:.1f}%) in {end[1]} s; {lever} reaches it at "
              + ", ".join(words) + f"; {lever} ends at FD {run[-1][3]:.2f} ({run[-1][2]:.1f}%) in {run[-1][1]} s")
