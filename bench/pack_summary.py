"""The summary table of one bench/on_gpu.sh part: one row per run, then the comparisons that part is for.

    python bench/pack_summary.py WORK PART      # WORK: on_gpu.sh's folder (runs.tsv, batches.tsv, pack/)

Rows come from runs.tsv (name, exit status, start and end as epoch seconds, budget). A train.py
run's numbers come from its run.json: the median step, img/s, MFU, the mode its step ran in, the
compile and the time to its first step (from launch: imports, data, model and the compile; the notes
give the three longest parts of its startup, run.json's startup_s, and its checkpoints' seconds the
steps waited and then beside them, checkpoint_times_s, and the mean milliseconds of each part of its steps,
time_breakdown_s). A diffusers run's come from its
progress bar: the rate of its last whole epoch after the first. A speed-ladder run's (python -m bench)
from its JSON: its last row that ran (its first call as the compile), the others in the notes. The
reference DiT step's (bench/dit_reference.py) from the run.json it writes, as a train.py run's.
"""

import json
import re
import sys
from datetime import datetime
from pathlib import Path

# profiling.STEP_PHASES (which imports torch; this runs without it): the parts of a step in run.json's time_breakdown_s
STEP_PHASES = ("data", "forward", "backward", "optimizer", "ema", "step")
COLUMNS = ("run", "exit", "wall s", "mode", "ms/step", "img/s", "MFU", "compile s", "1st step s", "peak GiB", "notes")


def read_rows(work):
    rows = []
    for line in (work / "runs.tsv").read_text().splitlines() if (work / "runs.tsv").exists() else []:
        name, code, start, end, budget = line.split("\t")
        rows.append(dict(name=name, code=code, start=float(start), end=float(end), budget=float(budget)))
    return rows


def train_numbers(pack, row):
    """What a train.py run's run.json says, or {} without one (the run did not finish)."""
    path = pack / f"{row['name']}.run.json"
    if not path.exists():
        return {}
    run = json.loads(path.read_text())
    started = datetime.fromisoformat(run["start_time"]).timestamp()
    notes = [f"{len(run['compile_fallbacks'])} fallback(s): {run['compile_fallbacks'][0]['error']}"] if run.get("compile_fallbacks") else []
    if run.get("cuda_graph_skips"):
        notes.append(f"{len(run['cuda_graph_skips'])} CUDA graph skip(s)")
    if run.get("startup_s"):  # train.py's "ready to train" line: its three longest parts
        longest = sorted(run["startup_s"].items(), key=lambda part: -part[1])[:3]
        notes.append(f"ready in {sum(run['startup_s'].values()):.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in longest))
    if run.get("checkpoint_times_s"):  # what of each checkpoint the steps waited for, and what went on beside them
        times = run["checkpoint_times_s"]
        wall = f" of {run['train_wall_s']:.1f} s training" if run.get("train_wall_s") else ""
        notes.append(f"{len(times)} checkpoint(s): the steps waited {sum(t['waited'] for t in times):.1f} s{wall}, "
                     f"then {sum(t['beside'] for t in times):.1f} s beside training")  # fmt: skip
    if run.get("time_breakdown_s") and run.get("steps"):  # where a step's time went, on average (CUDA events)
        per_step = {k: 1000 * run["time_breakdown_s"].get(k, 0) / run["steps"] for k in STEP_PHASES}
        notes.append("per step " + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items() if v) + " ms (mean)")
    step = run.get("median_step_time_s")
    return {
        "mode": run.get("step_compile_mode"),
        "ms/step": step and 1000 * step,
        "img/s": run.get("images_per_s"),
        "MFU": run.get("mfu") and 100 * run["mfu"],
        "compile s": run.get("compile_s"),
        "1st step s": started - row["start"] + (run.get("compile_s") or 0),
        "peak GiB": run.get("peak_memory_gib"),
        "notes": "; ".join(notes),
    }


def ladder_numbers(pack, row):
    """What a `python -m bench` run's JSON says: its last row that ran, every row's ms/step in the notes (and its mean
    loss against the first row's, where they differ)."""
    path = pack / f"{row['name']}.bench.json"
    if not path.exists():
        return {}
    ran = [r for r in json.loads(path.read_text())["results"] if r.get("step_time_s_median")]
    if not ran:
        return {"notes": "no row ran"}
    last, step = ran[-1], ran[-1]["step_time_s_median"]
    return {
        "mode": f"ladder {last['variant']}",
        "ms/step": 1000 * step,
        "img/s": last.get("images_per_s"),
        "MFU": last.get("mfu") and 100 * last["mfu"],
        "compile s": last.get("first_call_s"),  # its first call's seconds: a cold part's compile
        "peak GiB": last.get("peak_memory_gib"),
        # with each row's mean loss against the group's first where it differs (fp8's target: within 2% of bf16)
        "notes": "; ".join(f"{r['variant']} {1000 * r['step_time_s_median']:.3g} ms"
                           + (f" loss {100 * r['loss_vs_first']:+.2f}%" if r.get("loss_vs_first") else "") for r in ran),
    }


# tqdm's line at the end of an epoch: "Epoch 2: 100%|...| 64/64 [00:14<00:00,  4.45it/s, ...]"
EPOCH_LINE = re.compile(r"Epoch (\d+): 100%.*?(\d+)/\2 \[[^,]*,\s*([\d.]+)(it/s|s/it)")


def diffusers_numbers(log, batch):
    """The step rate of the last whole epoch after the first (which holds the start-up)."""
    rates = [(int(e), float(r) if unit == "it/s" else 1 / float(r)) for e, _, r, unit in EPOCH_LINE.findall(log)]
    later = [rate for epoch, rate in rates if epoch > 0] or [rate for _, rate in rates]
    if not later:
        return {"notes": "no whole epoch in its output"}
    return {"mode": "diffusers", "ms/step": 1000 / later[-1], "img/s": batch * later[-1], "notes": "tqdm rate, last epoch"}


def log_notes(log):
    """The line a run ended on that says most: a pytest summary, a score, or an error."""
    for pattern in (r"=+ (.*(?:passed|failed|error).*?) =+", r"(shape FD [^|]*\|[^|]*\| valid[^\n]*)", r"(FID [\d.]+[^\n]*)",
                    r"(class match [^\n]*)",
                    r"(\w*Error[^\n]*)"):  # fmt: skip
        found = re.findall(pattern, log)
        if found:
            return found[-1].strip()[:160]
    return ""


def fmt(value):
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def summarize(work, part):
    pack = work / "pack"
    batches = {}
    if (work / "batches.tsv").exists():
        batches = dict(line.split("\t") for line in (work / "batches.tsv").read_text().splitlines())
    table = []
    for row in read_rows(work):
        log_path = pack / f"{row['name']}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        numbers = {"exit": row["code"], "wall s": row["end"] - row["start"] if row["end"] else None}
        if row["name"] in batches:
            numbers |= diffusers_numbers(log, int(batches[row["name"]]))
        elif (pack / f"{row['name']}.bench.json").exists():
            numbers |= ladder_numbers(pack, row)
        else:
            numbers |= train_numbers(pack, row)
        if not numbers.get("notes"):
            numbers["notes"] = log_notes(log)
        table.append({"run": row["name"], **numbers})
    lines = [f"bench/on_gpu.sh {part}: {len(table)} run(s)", "\t".join(COLUMNS)]
    lines += ["\t".join(fmt(r.get(c)) for c in COLUMNS) for r in table]
    lines += comparisons(table)
    return "\n".join(lines) + "\n"


# A yardstick run's name ends in one of these: what the comparison calls its step.
YARDSTICKS = {"-diffusers": "diffusers' step", "-reference": "the reference step"}


def comparisons(table):
    """train.py's rows against the yardstick of the same workload (diffusers' script, or dit's reference DiT
    step): how many times faster per step."""
    out = []
    by_name = {r["run"]: r for r in table}
    for name, yardstick in by_name.items():
        suffix = next((s for s in YARDSTICKS if name.endswith(s)), None)
        if suffix is None or not yardstick.get("ms/step"):
            continue
        workload = name.removesuffix(suffix)
        for other in table:
            if other["run"].startswith(workload + "-") and other is not yardstick and other.get("ms/step"):
                out.append(f"{other['run']}: {yardstick['ms/step'] / other['ms/step']:.2f}x {YARDSTICKS[suffix]}")
    return out


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), sys.argv[2]), end="")
