import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from PIL import Image
from safetensors.torch import load_file

from ddpm_train.training import checkpoint
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
from ddpm_train.training import rundir
import sample
from ddpm_train.evaluation import sampling
import train
from conftest import ROOT
from ddpm_train.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_unet():
    torch.manual_seed(0)
    return models.build_network("tiny", 16).eval()


@pytest.fixture(scope="module")
def training_config():
    return objectives.make_noise_scheduler().config


@pytest.mark.parametrize("name", objectives.DDPMObjective.samplers)
def test_each_sampler_gives_images_of_the_right_shape_and_range_deterministic_by_seed(name, tiny_unet, training_config):
    scheduler = samplers.make_scheduler(name, training_config)
    seeds = sampling.image_seeds(0, 3)
    images = sampling.generate(tiny_unet, scheduler, seeds, num_inference_steps=4)
    assert images.shape == (3, 3, 16, 16) and images.dtype == torch.uint8
    assert images.float().std() > 5  # images, not a constant

    again = sampling.generate(tiny_unet, scheduler, seeds, num_inference_steps=4)
    assert torch.equal(images, again)
    other = sampling.generate(tiny_unet, scheduler, sampling.image_seeds(1, 3), num_inference_steps=4)
    assert not torch.equal(images, other)
    # image i depends on its own seed only, not on what else is in the batch
    split = torch.cat([sampling.generate(tiny_unet, scheduler, seeds[:1], 4), sampling.generate(tiny_unet, scheduler, seeds[1:], 4)])
    assert (split.int() - images.int()).abs().max() <= 1


def test_samplers_clip_the_clean_image_estimate_and_start_from_pure_noise(training_config):
    """The configuration that keeps fast samplers from saturating on an under-trained model."""
    for name in objectives.DDPMObjective.samplers:
        scheduler = samplers.make_scheduler(name, training_config)
        clips = scheduler.config.get("clip_sample") or (
            scheduler.config.get("thresholding") and scheduler.config.sample_max_value == 1.0
        )
        assert clips, name
        scheduler.set_timesteps(25)
        if name != "ddpm":
            assert scheduler.timesteps[0] == training_config.num_train_timesteps - 1, name
    assert samplers.make_scheduler("dpmsolver", training_config).config.algorithm_type == "dpmsolver++"
    assert samplers.make_scheduler("dpmsolver_sde", training_config).config.algorithm_type == "sde-dpmsolver++"


def test_the_sde_sampler_draws_fresh_noise_along_the_way(tiny_unet, training_config):
    """Same starting noise, same model: the SDE form ends elsewhere than the ODE form, because it
    adds noise at each step (that the noise follows the seeds: the parametrised test above)."""
    seeds = sampling.image_seeds(0, 2)
    ode = sampling.generate(tiny_unet, samplers.make_scheduler("dpmsolver", training_config), seeds, 4)
    sde = sampling.generate(tiny_unet, samplers.make_scheduler("dpmsolver_sde", training_config), seeds, 4)
    assert (ode.int() - sde.int()).abs().float().mean() > 2


@pytest.mark.parametrize("name", objectives.DDPMObjective.samplers)
def test_sampling_scheduler_in_train_is_the_same(name):
    """What train.py's grids and FID sample with (builder.build's) is what sample.py makes of the run's
    noise scheduler, for each sampler and a v-prediction run with another beta schedule."""
    from ddpm_train import config
    from ddpm_train.training import builder

    args = config.resolve(config.parse_args(["--model", "tiny", "--image_size", "16", "--objective", "ddpm", "--sampler", name,
                                             "--prediction_type", "v_prediction", "--beta_schedule", "linear"]))  # fmt: skip
    pieces = builder.build(args, total_steps=10)
    expected = samplers.make_scheduler(name, pieces.noise_scheduler.config)
    assert type(pieces.sampling_scheduler) is type(expected)
    assert dict(pieces.sampling_scheduler.config) == dict(expected.config)
    assert expected.config.prediction_type == "v_prediction" and expected.config.beta_schedule == "linear"
    args.vae = "a VAE"  # a latent run's samplers leave the latents unclipped: they are not images in [-1, 1]
    latent = builder.build(args, total_steps=10).sampling_scheduler.config
    assert not (latent.get("clip_sample") or latent.get("thresholding")), name


# --- sample.py on a tiny trained run ------------------------------------------------

TINY = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "32", "--train_batch_size", "8",
    "--num_inference_steps", "2", "--eval_batch_size", "4", "--lr_warmup_steps", "1", "--dataloader_num_workers", "0",
    "--max_train_steps", "4", "--checkpointing_steps", "4", "--save_images_epochs", "100",
    "--logging_steps", "4", "--learning_rate", "1e-3", "--objective", "ddpm",  # DDPM's samplers (test_flow.py: flow's)
]  # fmt: skip


def train_tiny(output_dir, *flags):
    args = train.parse_args([*TINY, "--output_dir", str(output_dir), *flags])
    args.timing_warmup_steps = 1  # a config.SETTINGS (train.py: 5): runs this short leave only their first step out
    return train.main(args)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train_tiny(out)
    return out


def sample_main(*flags):
    return sample.main(sample.parse_args([*map(str, flags)]))


def pngs(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


def test_sample_writes_n_images_and_a_grid_and_the_same_seed_gives_the_same_files(tiny_run, tmp_path):
    flags = [tiny_run, "--num_images", 5, "--batch_size", 2, "--num_inference_steps", 3]
    sample_main(*flags, "--output", tmp_path / "a")
    written = pngs(tmp_path / "a")
    assert sorted(written) == [f"{i:06d}.png" for i in range(5)] + ["copies.png", "grid.png"]
    with Image.open(tmp_path / "a" / "000004.png") as image:
        assert image.size == (16, 16) and image.mode == "RGB"
    with Image.open(tmp_path / "a" / "grid.png") as grid:
        assert grid.size == (3 * 16 + 4 * 2, 2 * 16 + 3 * 2)  # 5 images, 3 per row, 2-pixel padding

    sample_main(*flags, "--output", tmp_path / "b")
    assert pngs(tmp_path / "b") == written
    sample_main(*flags, "--output", tmp_path / "c", "--seed", 1)
    assert pngs(tmp_path / "c")["000000.png"] != written["000000.png"]
    # a folder that holds samples already is not written over: one line, the first sampling's files kept
    with pytest.raises(SystemExit) as exit_info:
        sample_main(*flags, "--output", tmp_path / "a", "--seed", 1)
    assert exit_info.value.code == 2 and pngs(tmp_path / "a") == written


def test_a_checkpoint_gives_its_ema_weights_by_default_and_raw_ones_with_no_ema(tiny_run, tmp_path):
    checkpoint = tiny_run / "checkpoints" / "checkpoint-4"
    flags = ["--num_images", 2, "--num_inference_steps", 2]
    sample_main(tiny_run, *flags, "--output", tmp_path / "pipeline")  # the final pipeline: the EMA at step 4
    sample_main(checkpoint, *flags, "--output", tmp_path / "ema")
    sample_main(checkpoint, *flags, "--output", tmp_path / "raw", "--no-ema")
    assert pngs(tmp_path / "ema") == pngs(tmp_path / "pipeline")
    assert pngs(tmp_path / "raw") != pngs(tmp_path / "ema")

    unet, _ = rundir.load_model(checkpoint, ema=False)
    raw = load_file(str(checkpoint / "model.safetensors"))
    assert all(torch.equal(unet.state_dict()[k], raw[k]) for k in raw)


def test_a_run_without_an_ema_samples_its_raw_weights_by_default_and_refuses_ema(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    train_tiny(out, "--ema", "none")
    checkpoint = out / "checkpoints" / "checkpoint-4"
    raw = load_file(str(checkpoint / "model.safetensors"))
    for source in (out, checkpoint):  # the pipeline holds the raw weights, and a checkpoint gives them
        unet, _ = rundir.load_model(source)
        assert all(torch.equal(unet.state_dict()[k], raw[k]) for k in raw), source
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        sample_main(out, "--ema", "--num_images", 1, "--output", tmp_path / "x")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "kept no EMA" in line


def before_issue_37(config):
    """`config` (a train_config.json) as train.py wrote it before issue 37: its settings beside its flags,
    and what config.resolve derived of merged flags then (use_ema, center_crop, ...)."""
    old = {k: v for k, v in config.items() if k not in ("settings", "augment")} | config["settings"]
    return old | dict(use_ema=config["ema"] != "none", center_crop="crop" not in config["augment"],
                      random_flip="flip" in config["augment"], compile=config["compile_mode"] != "off")  # fmt: skip


@pytest.mark.parametrize("style", ["today", "before issue 37"])
def test_a_runs_settings_and_ema_are_read_from_its_train_config_json_of_today_or_before(tiny_run, tmp_path, capsys, style):
    """Today's train_config.json keeps the settings under "settings"; an older one beside the flags, with
    use_ema deciding whether the run kept an EMA (here: not, though its --ema names one)."""
    run, step = tmp_path / "run", "checkpoints/checkpoint-4"
    shutil.copytree(tiny_run / step, run / step)
    config = json.loads((tiny_run / "train_config.json").read_text())
    config["settings"] |= dict(num_train_timesteps=500, sigma_data=0.25)  # not train.py's: seen only if read
    config = before_issue_37(config) | dict(use_ema=False) if style != "today" else config | dict(ema="none")
    assert ("settings" in config) == (style == "today") and ("use_ema" in config) != (style == "today")
    (run / "train_config.json").write_text(json.dumps(config))

    source = rundir.RunDir(run)
    assert source.setting("sigma_data", objectives.SIGMA_DATA) == 0.25 and not source.kept_ema
    unet, scheduler = source.load()
    assert scheduler["num_train_timesteps"] == 500
    raw = load_file(str(run / step / "model.safetensors"))  # no EMA kept: the raw weights, not the EMA's
    assert all(torch.equal(unet.state_dict()[k], raw[k]) for k in raw)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        sample_main(run, "--num_inference_steps", 501, "--num_images", 1, "--output", tmp_path / "x")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "cannot exceed the model's 500 training timesteps" in line
    with pytest.raises(sample.ConfigError, match="the guide was trained with num_train_timesteps 1000, the model with 500"):
        sampling.check_guide(config, json.loads((tiny_run / "train_config.json").read_text()))


def test_sample_reports_the_share_of_copies_of_the_training_images_and_their_picture(tiny_run, tmp_path, monkeypatch, capsys):
    from ddpm_train.data import shapes

    result = sample_main(tiny_run, "--num_images", 5, "--batch_size", 2, "--num_inference_steps", 2, "--output", tmp_path / "a")
    assert 0 <= result["copy_share"] <= 1 and result["copy_samples"] == 5 and result["training_images"] == 32
    assert f"copies {result['copy_share']:.1%} (" in capsys.readouterr().out
    with Image.open(tmp_path / "a" / "copies.png") as picture:
        assert picture.size == (8 * 16 + 9 * 2, 2 * 16 + 3 * 2)  # 5 pairs, 4 a row
    # samples that are the run's training images (its shapes, its seed), the third mirrored: all copies
    drawn = shapes.builtin_images(32, 16, json.loads((tiny_run / "train_config.json").read_text())["seed"])[0]
    copied = torch.stack([drawn[0], drawn[1], drawn[2].flip(-1), drawn[3]])
    monkeypatch.setattr(sampling, "generate_batches", lambda *a, **k: iter([copied[:2], copied[2:]]))
    result = sample_main(tiny_run, "--num_images", 4, "--batch_size", 2, "--output", tmp_path / "b")
    assert result["copy_share"] == 1 and result["median_ratio"] == 0
    assert "copies 100.0% (4 of 4 samples nearer one of 32 training images and their mirror images" in capsys.readouterr().out
    result = sample_main(tiny_run, "--num_images", 4, "--batch_size", 2, "--output", tmp_path / "c", "--no-copies")
    assert "copy_share" not in result and not (tmp_path / "c" / "copies.png").exists()


def test_a_run_whose_training_images_are_not_here_samples_without_the_copy_check(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((run / "train_config.json").read_text())
    (run / "train_config.json").write_text(json.dumps(config | dict(dataset=str(tmp_path / "moved"))))
    pipeline = tmp_path / "pipeline"  # the saved pipeline alone, outside any run
    for part in ("unet", "scheduler"):
        shutil.copytree(run / part, pipeline / part)
    shutil.copy(run / "model_index.json", pipeline)
    for source, why in ((run, "the run's training images cannot be opened"), (pipeline, "in no run folder")):
        result = sample_main(source, "--num_images", 2, "--num_inference_steps", 1, "--output", tmp_path / source.name / "out")
        err = capsys.readouterr().err
        assert "copy_share" not in result and "no copy check: " in err and why in err and (tmp_path / source.name / "out" / "000001.png").is_file()
        assert not (tmp_path / source.name / "out" / "copies.png").exists()


def test_sample_with_fid_scores_the_images(tiny_run, tmp_path, monkeypatch, capsys):
    from ddpm_train.evaluation import metrics
    from test_metrics import TinyFeatures

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    # Inception weights given: "Inception" (the stand-in), not the shape scorer of tests/test_shapescore.py
    result = sample_main(tiny_run, "--fid", "--num_images", 6, "--num_inference_steps", 2, "--output", tmp_path,
                         "--fid_weights", "inception.pth")  # fmt: skip
    assert result["fid"] > 0 and result["reference_images"] == 32  # the run's training set
    assert (tiny_run / metrics.REFERENCE_FILE).is_file() and (tmp_path / "fid.json").is_file()
    assert f"FID {result['fid']:.3f} | KID" in capsys.readouterr().out


# sample.py as a rank of a launch (test_faults.start_two_ranks' environment), with the stand-in for Inception.
SAMPLE_RANK = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from ddpm_train.evaluation import metrics
import sample
from test_metrics import TinyFeatures
metrics.feature_extractor = lambda weights=None: (TinyFeatures(), "tiny-features")
try:
    sample.main(sample.parse_args([a for a in sys.argv[1:] if a != "--cpu"]))  # start_two_ranks' --cpu is train.py's
finally:
    import torch.distributed
    print("process group left:", torch.distributed.is_initialized())
"""


@pytest.mark.slow
def test_two_processes_write_the_images_grid_and_scores_one_process_does(tiny_run, tmp_path, monkeypatch):
    """torchrun or accelerate launch: each process generates every other batch and writes its images; rank 0
    gathers them for the grid and FID. 5 images in batches of 2: the same files and scores, bit for bit."""
    from ddpm_train.evaluation import metrics
    from test_faults import Ranks, start_two_ranks
    from test_metrics import TinyFeatures

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    flags = [tiny_run, "--fid", "--num_images", 5, "--batch_size", 2, "--num_inference_steps", 2, "--fid_weights", "inception.pth"]
    sample_main(*flags, "--output", tmp_path / "one")
    # the training set's statistics found nowhere: made again, a share on each process
    (tiny_run / metrics.REFERENCE_FILE).unlink()
    shutil.rmtree(os.environ[metrics.REFERENCE_CACHE_ENV])
    script = SAMPLE_RANK.format(root=str(ROOT), tests=str(ROOT / "tests"))
    ranks = Ranks(start_two_ranks([*flags, "--output", tmp_path / "two"], script))
    assert ranks.codes == [0, 0], ranks
    assert "computing FID reference statistics of 32 images on 2 processes" in ranks.out0
    one, two = pngs(tmp_path / "one"), pngs(tmp_path / "two")
    assert sorted(two) == [f"{i:06d}.png" for i in range(5)] + ["copies.png", "grid.png"] and one == two
    one, two = (json.loads((tmp_path / run / "fid.json").read_text()) for run in ("one", "two"))
    # the sums' order, and KID's float32 features: a last-bit difference (1e-7 relative) seen once in the suite
    assert two == pytest.approx(one, rel=1e-6) and two["reference_images"] == 32
    assert "wrote 5 images and grid.png to" in ranks.out0 and "(2 processes)" in ranks.out0
    assert ranks.out1 == "process group left: False\n" and ranks.err1 == ""  # rank 0 says what both did
    assert "process group left: False" in ranks.out0

    # rank 1 cannot load the network for its share of the statistics: its one line, rank 0 stops with it, silent
    (tiny_run / metrics.REFERENCE_FILE).unlink()
    shutil.rmtree(os.environ[metrics.REFERENCE_CACHE_ENV])
    no_network = script.replace("try:", """import os
from ddpm_train.errors import ConfigError
if os.environ["RANK"] == "1":
    def missing(*args, **kwargs):
        raise ConfigError("no Inception weights on this node")
    metrics.extractor_for = missing
try:""", 1)
    ranks = Ranks(start_two_ranks([*flags, "--output", tmp_path / "four"], no_network), timeout=120)
    assert ranks.codes == [2, 2], ranks
    assert ranks.err1.strip().splitlines()[-1] == "sample.py: error: no Inception weights on this node" and ranks.err0 == ""
    assert not list(Path(os.environ[metrics.REFERENCE_CACHE_ENV]).glob(".claim-*"))  # rank 0's claim to make them: given up
    # rank 0's reference cannot be made: its one line, and the other process stops with it, silent
    ranks = Ranks(start_two_ranks([*flags, "--dataset", tmp_path / "none", "--output", tmp_path / "three"], script))
    assert ranks.codes == [2, 2], ranks
    assert ranks.err0.count("\n") == 1 and "sample.py: " in ranks.err0 and "none" in ranks.err0 and ranks.err1 == ""
    assert sample.device_of_process("cuda", 3) == "cuda:3" and sample.device_of_process("cuda:1", 3) == "cuda:1"
    assert sample.device_of_process("cpu", 3) == "cpu"


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_exit_130_while_importing_and_while_sampling(tiny_run, tmp_path, monkeypatch, capsys):
    process = subprocess.Popen([sys.executable, "sample.py", str(tiny_run), "--output", str(tmp_path / "x")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.5)  # torch's import alone takes longer
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.strip() == "sample.py: interrupted while starting: nothing was written", err
    # imported, a Ctrl-C is main's: here as the run is opened (rundir is imported first: sample.py finds it patched)
    script = ("import os, runpy, signal, sys\nfrom ddpm_train.training import rundir\n"
              "opened = rundir.RunDir.__init__\n"
              "def interrupted(self, *args):\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    opened(self, *args)\n"
              "rundir.RunDir.__init__ = interrupted\n"
              "sys.argv = ['sample.py', *sys.argv[1:]]\n"
              "runpy.run_path('sample.py', run_name='__main__')\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, str(tiny_run), "--output", str(tmp_path / "z")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 130 and done.stderr.strip().splitlines()[-1].startswith("sample.py: interrupted: stopped"), done.stderr

    def interrupted(*args, **kwargs):  # the first batch written, then Ctrl-C
        yield torch.zeros(2, 3, 16, 16, dtype=torch.uint8)
        raise KeyboardInterrupt

    monkeypatch.setattr(sampling, "generate_batches", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        sample_main(tiny_run, "--num_images", 4, "--batch_size", 2, "--output", tmp_path / "y")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 130 and err[-1] == "sample.py: interrupted: stopped before the end; the images written so far stay"
    assert sorted(p.name for p in (tmp_path / "y").iterdir()) == ["000000.png", "000001.png"]


SAMPLE_ERRORS = [
    (["{run}", "--num_images", "2"], "--output DIR"),
    (["{run}", "--num_images", "0", "--output", "x"], "--num_images must be at least 1"),
    (["{run}/nothing", "--output", "x"], "no such folder"),
    (["{run}", "--no-ema", "--output", "x"], "holds the EMA weights only"),
    (["{run}", "--num_inference_steps", "2000", "--output", "x"], "cannot exceed"),
    (["{run}", "--sampler", "euler", "--output", "x"], "--sampler euler samples a flow run"),
    (["{run}", "--sampler", "lms", "--output", "x"], "invalid choice: 'lms'"),
    (["{run}", "--guidance_scale", "2", "--output", "x"], "has no classes, so give --guide RUN"),
    (["{run}", "--device", "gpu", "--output", "x"], "--device gpu: not a device torch knows"),
    (["{run}", "--output", "{run}/train_config.json"], "train_config.json is a file, not a folder"),
] + ([(["{run}", "--device", "cuda", "--output", "x"], "no CUDA GPU torch can use")] if not torch.cuda.is_available() else [])


@pytest.mark.parametrize("flags, message", SAMPLE_ERRORS, ids=[m for _, m in SAMPLE_ERRORS])
def test_bad_sample_input_is_one_line_and_exit_code_2(tiny_run, tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        sample_main(*[f.format(run=tiny_run) for f in flags])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], err
    assert not list(tmp_path.rglob("*.png"))


@pytest.mark.parametrize("damaged", ["unet/diffusion_pytorch_model.safetensors", "unet/config.json", "train_config.json",
                                     "checkpoint/model.safetensors"])  # fmt: skip
def test_a_damaged_run_is_one_line_and_exit_code_2(tiny_run, tmp_path, capsys, damaged):
    """A copy cut short, a disk's fault: what cannot be read is named in one line, not diffusers' or torch's traceback."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    source = checkpoint.checkpoint_dirs(run)[-1] if damaged.startswith("checkpoint/") else run
    file = source / damaged.removeprefix("checkpoint/")
    file.write_bytes(file.read_bytes()[:30])
    with pytest.raises(SystemExit) as exit_info:
        sample_main(source, "--num_images", 1, "--num_inference_steps", 1, "--output", tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1 and "cannot read" in err[0] and "damaged" in err[0], err


def test_a_checkpoint_removed_while_it_is_read_says_so(tiny_run, tmp_path, monkeypatch):
    """A run still training drops its old checkpoints past its total limit: the one being read may go."""
    folder = tmp_path / "checkpoints" / "checkpoint-8"
    shutil.copytree(checkpoint.checkpoint_dirs(tiny_run)[-1], folder)
    shutil.copy(tiny_run / "train_config.json", tmp_path)  # a run folder around it
    real = safetensors.torch.load_model

    def removed_meanwhile(model, path, *args, **kwargs):
        shutil.rmtree(folder)
        return real(model, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_model", removed_meanwhile)
    with pytest.raises(ConfigError, match="was removed while it was read .*run the command again"):
        rundir.RunDir(folder).load()


def test_a_pipeline_outside_a_run_says_its_objective_by_its_scheduler(tmp_path):
    """Flow's scheduler says flow with its shift; DDPM's says DDPM, a schedule --init_from would refuse too."""
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    for name, scheduler in (("flow", FlowMatchEulerDiscreteScheduler(shift=3.0)), ("odd", DDPMScheduler(num_train_timesteps=500))):
        scheduler.save_pretrained(str(tmp_path / name / "scheduler"))
    assert rundir.RunDir(tmp_path / "flow").objective == "flow:3" and rundir.RunDir(tmp_path / "odd").objective == "ddpm"
