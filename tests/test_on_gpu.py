"""bench/on_gpu.sh in its CPU mode: each part writes its two files, with every run in them, before
a GPU ever sees the script; the deadline skips runs but never the pack; the summary reads
train.py's run.json and diffusers' progress bar."""

import os
import subprocess
import tarfile

import pytest

from conftest import ROOT

import sys

sys.path.insert(0, str(ROOT / "bench"))
import pack_summary  # noqa: E402

RUNS = {
    "tests": ["cuda-tests", "bare", "bare-shape-fd"],
    "graphs": ["graphs-tests", "ddpm32-graph-ladder", "adm64-graph-ladder", "bare-eager-graph", "bare-eager-graph-shape-fd"],
    "ref128": ["ref128-default-cold", "ref128-default-warm", "ref128-diffusers", "ref128-step-graph"],
    "adm64": ["adm64-auto-cold", "adm64-step-graph", "adm64-default", "adm64-diffusers"],
    "fused": ["ref128-fused", "adm64-fused"],
    "dit": ["dit-default-cold", "dit-profile", "dit-ladder", "dit-reference", "dit-autotune"],
    "routing": ["dit-routing"],
    "cold": ["dit-regional", "dit-regional-inductor", "ddpm32-regional", "ddpm32-whole", "dit-whole", "bare-cold"],
    "terms": [f"{family}-{term}-s{seed}{score}" for family in ("dit-b2", "adm64") for seed in (1, 2) for term in ("none", "deltafm")
              for score in ("", "-score")],
}


def on_gpu(part, folder, **env):
    """The script run by this interpreter (PYTHON), as a venv's python -m pytest runs it without activating the venv."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"ON_GPU_CPU": "1", "PYTHON": sys.executable} | env
    return subprocess.run(["bash", str(ROOT / "bench" / "on_gpu.sh"), part, str(folder)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def packed(folder, part):
    with tarfile.open(folder / f"{part}.tar.gz") as tar:
        return {name.removeprefix("./") for name in tar.getnames()}


@pytest.mark.slow
def test_a_part_packs_every_run_into_two_files(tmp_path):
    """A train.py run inside a part (ref128's first; ON_GPU_RUNS leaves the others out, which their own test
    checks): its printed lines, run.json, train_config.json and last grid land in the pack, and its row in the
    summary. A python3 first on PATH that has no torch (an unactivated venv's case) is not used: PYTHON is.
    The speed ladder's runs (bench_run) pack their JSON, which test_bench reads with pack_summary."""
    part, run = "ref128", "ref128-default-cold"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\necho \"No module named 'torch'\" >&2\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    done = on_gpu(part, out, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", ON_GPU_RUNS=run)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [f"{part}-summary.txt", f"{part}.tar.gz"]
    names = packed(out, part)
    assert {"nvidia-smi.txt", "versions.txt", "on_gpu.log", "summary.txt"} <= names
    assert {f"{run}.log", f"{run}.run.json", f"{run}.train_config.json", f"{run}.grid.png"} <= names, names
    summary = (out / f"{part}-summary.txt").read_text().splitlines()
    rows = {line.split("\t")[0]: line.split("\t") for line in summary[2:] if "\t" in line}
    assert rows[run][1] == "0" and rows[run][3] == "eager", summary  # exit status; the mode its run.json records


@pytest.mark.slow
@pytest.mark.parametrize("part", RUNS)
def test_the_deadline_skips_runs_but_every_part_writes_its_pack(tmp_path, part):
    done = on_gpu(part, tmp_path, DEADLINE_S="0")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = (tmp_path / f"{part}-summary.txt").read_text()
    for run in RUNS[part]:
        if run.endswith(("-shape-fd", "-score")):  # scored only when the run finished
            assert run not in summary
            continue
        assert any(f"{run}\t{why}" in summary for why in ("skipped", "not carried", "CPU mode")), summary
    assert {"versions.txt", "summary.txt"} <= packed(tmp_path, part)


def test_an_unknown_part_is_one_line_and_exit_2(tmp_path):
    done = on_gpu("all", tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == ["usage: bash bench/on_gpu.sh tests|graphs|ref128|adm64|fused|dit|cold|terms|routing [FOLDER]"]


@pytest.mark.slow
def test_the_terms_part_trains_a_term_on_the_labelled_photos_and_scores_it(tmp_path):
    """Issue 66's GPU part: a run with a loss term trains on the labelled photos (written by the part where
    scikit-image is installed), class-conditional at its seed; sample.py samples it and bench.labelled scores it,
    and the score is the score run's note in the summary."""
    import json

    run = "adm64-deltafm-s2"
    done = on_gpu("terms", tmp_path, ON_GPU_RUNS=f"{run} {run}-score")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split("\t")[0]: line.split("\t") for line in (tmp_path / "terms-summary.txt").read_text().splitlines()[2:]}
    assert rows[run][1] == "0" and rows[f"{run}-score"][1] == "0", rows
    assert "class match" in rows[f"{run}-score"][-1] and "photos FD" in rows[f"{run}-score"][-1], rows
    # the runs left out are "not chosen", and only a run that finished is scored
    assert set(rows) == {r for r in RUNS["terms"] if not r.endswith("-score")} | {f"{run}-score"}, rows
    assert {rows[r][1] for r in rows if not r.startswith(run)} == {"not chosen"}
    assert {f"{run}.classes.png", f"{run}-score.log"} <= packed(tmp_path, "terms")
    with tarfile.open(tmp_path / "terms.tar.gz") as tar:
        config = json.load(tar.extractfile(f"./{run}.train_config.json"))
    assert (config["loss_terms"], config["seed"], config["class_conditional"]) == ("deltafm:0.05", 2, True)


def test_the_summary_reads_diffusers_progress_bar_after_its_first_epoch():
    log = ("Epoch 0: 100%|██████████| 64/64 [00:40<00:00,  1.60it/s, loss=0.1]\r\n"
           "Epoch 1:  50%|█████     | 32/64 [00:07<00:07,  4.40it/s, loss=0.1]\r"
           "Epoch 1: 100%|██████████| 64/64 [00:14<00:00,  4.45it/s, loss=0.1]\n")  # fmt: skip
    numbers = pack_summary.diffusers_numbers(log, 64)
    assert numbers["ms/step"] == pytest.approx(1000 / 4.45) and numbers["img/s"] == pytest.approx(64 * 4.45)
    slow = pack_summary.diffusers_numbers("Epoch 1: 100%|█| 8/8 [00:16<00:00,  2.00s/it]\n", 4)
    assert slow["ms/step"] == pytest.approx(2000)
    assert pack_summary.log_notes("..\n==== 9 passed, 1 failed in 80.1s ====\n") == "9 passed, 1 failed in 80.1s"
    table = [dict(run="ref128-diffusers", **{"ms/step": 222.0}), dict(run="ref128-default-warm", **{"ms/step": 74.0})]
    assert pack_summary.comparisons(table) == ["ref128-default-warm: 3.00x diffusers' step"]


def test_only_the_runs_named_in_on_gpu_runs_run(tmp_path):
    """ON_GPU_RUNS leaves out what an earlier record measured: the others get a "not chosen" row, the
    named one goes on to the deadline (0 here, so it is skipped there, not left out)."""
    done = on_gpu("ref128", tmp_path, DEADLINE_S="0", ON_GPU_RUNS="ref128-default-cold")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("\t")[0]: line.split("\t")[1] for line in (tmp_path / "ref128-summary.txt").read_text().splitlines()[2:]}
    assert rows["ref128-default-cold"] == "skipped"
    assert {rows[run] for run in RUNS["ref128"][1:] if run != "ref128-diffusers"} == {"not chosen"}


def test_the_dit_part_compares_our_runs_with_the_reference_dit_step(tmp_path):
    """The reference step (bench/dit_reference.py) writes a run.json the summary reads as a train.py run's, and the
    dit runs are compared with it as ref128's are with diffusers' script."""
    import json

    pack = tmp_path / "pack"
    pack.mkdir()
    (tmp_path / "runs.tsv").write_text("dit-default-cold\t0\t100\t200\t230\ndit-reference\t0\t200\t250\t80\n")
    for name, ms in (("dit-default-cold", 125.0), ("dit-reference", 250.0)):
        (pack / f"{name}.run.json").write_text(json.dumps(dict(start_time="1970-01-01T00:03:30+00:00", median_step_time_s=ms / 1e3)))
    startup = dict(imports=4.0, accelerate=0.5, data=9.5, network=3.0, step=0.01)  # train.py's startup_s
    run = json.loads((pack / "dit-default-cold.run.json").read_text())
    flushes = [dict(step=100, waited=0.5, beside=7.5), dict(step=120, waited=4.5, beside=7.0)]
    breakdown = dict(data=1.5, forward=4.3, backward=9.2, optimizer=1.25, ema=0.75, step=0.0, compile=84.7)
    (pack / "dit-default-cold.run.json").write_text(json.dumps(run | dict(startup_s=startup, checkpoint_times_s=flushes, train_wall_s=80.0,
                                                                          time_breakdown_s=breakdown, steps=125)))  # fmt: skip
    summary = pack_summary.summarize(tmp_path, "dit")
    assert "dit-default-cold: 2.00x the reference step" in summary.splitlines()
    # a train.py run's notes say how long it took to be ready to train, and its longest parts
    assert "ready in 17.0 s: data 9.5, imports 4.0, network 3.0" in summary
    # and where its steps' time went, per step (the compile is not a step's)
    assert "per step data 12.0, forward 34.4, backward 73.6, optimizer 10.0, ema 6.0 ms (mean)" in summary
    from ddpm_train.perf import profiling

    assert pack_summary.STEP_PHASES == profiling.STEP_PHASES
    assert "2 checkpoint(s): the steps waited 5.0 s of 80.0 s training, then 14.5 s beside training" in summary
