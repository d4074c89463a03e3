"""The curves of this record from run.sh's scores: FD (and class match) against steps, and the "faster" ratios.

    python curves.py /tmp/lc          # prints the tables, writes curves.png beside this file

The ratio is issue 66's: the steps a run needs to reach the default's final FD (its curve taken as straight between
the scored points; the first crossing) over the steps the default needed (all of them, 4x the bare budget). Per seed,
against that seed's default, and for the mean of the two seeds' curves against the default's mean curve.
"""

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINE = re.compile(r"^(\S+) steps (\d+) .*?\| (.*)$")
BARE = {"fc": 640, "lab": 6144}


def read(folder):
    """{run: {steps: {"fd": .., "match": ..}}} from scores.txt and the labelled runs' JSON."""
    runs = {}
    for line in (folder / "scores.txt").read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        name, steps, rest = m.group(1), int(m.group(2)), m.group(3)
        point = {}
        if name.startswith("fc_"):
            point["fd"] = float(re.search(r"faces FD ([\d.]+)", rest).group(1))
        else:
            scores = json.loads((folder / f"{name}-at{steps}.json").read_text())
            point = {"fd": scores["fd"], "match": 100 * scores["match"], "se": 100 * scores["se"]}
        runs.setdefault(name, {})[steps] = point
    return runs


def steps_to(curve, target):
    """The first step at which the curve, straight between its points, is at or below target; None if never."""
    points = sorted((s, p["fd"]) for s, p in curve.items())
    if points[0][1] <= target:
        return points[0][0]
    for (s0, f0), (s1, f1) in zip(points, points[1:]):
        if f1 <= target:
            return s0 + (s1 - s0) * (f0 - target) / (f0 - f1)
    return None


def ratio(curve, default, bare):
    target = default[4 * bare]["fd"]
    need = steps_to(curve, target)
    said = "not reached in 4x" if need is None else f"at {need / bare:.2f}x bare: {need / (4 * bare):.2f} of the default's steps"
    return f"to the default's final FD ({target:.2f}): {said}"


def mean_curve(curves):
    """The points both curves have, each the mean of their FDs; None unless both runs exist."""
    if not all(curves):
        return None
    return {s: {"fd": sum(c[s]["fd"] for c in curves) / len(curves)} for s in set.intersection(*(set(c) for c in curves))}


def main(folder):
    runs = read(folder)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (prefix, title) in zip(axes, (("fc", "faces, dit-small: faces FD"), ("lab", "labelled photos, small, w = 1: photos FD"))):
        print(f"\n## {title}")
        bare = BARE[prefix]
        for seed in (1, 2):
            default = runs.get(f"{prefix}_none_s{seed}")
            for term in ("none", "deltafm"):
                name = f"{prefix}_{term}_s{seed}"
                curve = runs.get(name)
                if not curve:
                    continue
                row = "  ".join(f"{s // bare if s % bare == 0 else s / bare:g}x {p['fd']:.2f}"
                                + (f" ({p['match']:.1f}%)" if "match" in p else "") for s, p in sorted(curve.items()))
                print(f"{name}: {row}")
                ax.plot([s / bare for s in sorted(curve)], [curve[s]["fd"] for s in sorted(curve)], marker="o",
                        linestyle="-" if term == "none" else "--", color=f"C{seed - 1}", label=f"{term}, seed {seed}")
                if term != "none" and default and 4 * bare in default:
                    print(f"  {ratio(curve, default, bare)}")
        means = {t: mean_curve([runs.get(f"{prefix}_{t}_s{seed}") for seed in (1, 2)]) for t in ("none", "deltafm")}
        if all(means.values()):
            for t, curve in means.items():
                print(f"mean {t}: " + "  ".join(f"{s / bare:g}x {p['fd']:.2f}" for s, p in sorted(curve.items())))
            print(f"  mean curves: {ratio(means['deltafm'], means['none'], bare)}")
        ax.set(title=title, xlabel="steps / bare budget (4x schedule)", ylabel="FD (lower is better)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("curves.png"), dpi=90)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
