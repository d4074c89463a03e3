"""Print each run's score from /tmp/imk4/lm (or the folder given): faces FD from scores.txt, class match and photos FD
from each labelled run's -gen.json, with the two seeds side by side."""
import json
import re
import sys
from pathlib import Path

d = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/imk4/lm")
rows = {}
for line in (d / "scores.txt").read_text().splitlines():
    name = line.split()[0]
    base, seed = name.rsplit("_s", 1)
    train_s = re.search(r"train_s=(\d+)", line).group(1)
    m = re.search(r"faces FD ([\d.]+)", line)
    if m:
        score = f"{float(m.group(1)):.2f}"
    else:
        j = json.loads((d / f"{name}-gen.json").read_text())
        score = f"{100 * j['match']:.1f}% / {j['fd']:.2f}"
    rows.setdefault(base, {})[seed] = f"{score} ({train_s} s)"
for base, seeds in rows.items():
    print(f"{base:24s} seed 1: {seeds.get('1', '-'):24s} seed 2: {seeds.get('2', '-')}")
