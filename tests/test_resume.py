"""Resuming refuses every setting that changes what a checkpoint holds or means (rules.RUN_IDENTITY).

Through `rules.choose_start` on fake checkpoint folders (a trainer_state.json, and a
train_config.json where a row needs one): milliseconds. Two `train.main` runs at the end.
"""

import argparse
import json
import re

import numpy as np
import pytest
import torch

from ddpm_train.training import checkpoint
from ddpm_train import config
from ddpm_train.data import autoencoder
from ddpm_train.evaluation import metrics
from ddpm_train.diffusion import objectives
from ddpm_train.training import resume as rules
from ddpm_train.errors import ConfigError
from test_config import OLD_RUNS
from test_metrics import TinyFeatures
from test_train import TINY, tensors_of
from test_train import run as train

DERIVED = tuple(rules.DERIVED_IDENTITY)
SAFE = [flag for flags in rules.CHANGES_ON_RESUME.values() for flag in flags]

# One changed value per identity key (each differs from BASE's: checked below).
CHANGED = dict(
    model="small", image_size=32, class_conditional=True, num_classes=4,
    dataset="photos/", dataset_config="full", split="test", image_column="img",
    shapes_num_images=128, augment="flip,crop", train_batch_size=16, gradient_accumulation_steps=2, num_processes=2,
    seed=1, objective="edm", prediction_type="sample", beta_schedule="squaredcos_cap_v2",
    zero_terminal_snr=True, learning_rate=1e-3, adam_betas=[0.9, 0.99], weight_decay=0.0, ema="power",
    ema_stds=[0.05, 0.2], ema_max_decay=0.999, ema_power=2 / 3, mixed_precision="fp16",
    latent_space=dict(encoder_sha256="ab" * 32, normalization=dict(kind="dataset")),  # a latent run's (issue 37)
    flow_sigmas="logit_normal(0,1)",  # a flow run's (issue 38)
    image_channels=1, image_bits=16,  # a grayscale set's, of 16 bits (issue 64)
    init_from="google/ddpm-cifar10-32",  # a fine-tune's source (issue 65)
    loss_terms="dispersive:0.25",  # the objective's terms (issue 66)
    optimizer="muon",  # what the optimizer's saved state is (issue 76)
    text_encoder="openai/clip-vit-base-patch32", caption_column="caption", text_dim=768,  # a captioned run's (issue 77)
)  # fmt: skip

# How a refusal names a change of each identity key: "--flag before -> after", or in words.
def change_words(key, before, after):
    if key == "latent_space":
        return autoencoder.latent_space_change(before, after)
    if key == "num_processes":  # what to change is the launch, not a flag
        return f"processes {before!r} -> {after!r}: launch it with {before}"
    return f"{named(key)} {before!r} -> {after!r}"


# A record of fewer keys than RUN_IDENTITY: what the "run" of a checkpoint written before the others were checked holds.
OLD_IDENTITY = (
    "model", "image_size", "dataset", "dataset_config", "split", "image_column", "shapes_num_images",
    "train_batch_size", "gradient_accumulation_steps", "num_processes", "seed", "beta_schedule", "prediction_type",
    "objective",
)  # fmt: skip


def resolved(*flags):
    """The config train.py hands choose_start for TINY plus `flags` (one process, unconditional), a DDPM run
    unless `flags` say otherwise."""
    args = config.resolve(config.parse_args([*TINY, "--output_dir", "unused", "--objective", "ddpm", *flags]))  # DDPM's keys too
    return vars(args) | dict(num_processes=1, num_classes=0, latent_space=None,
                             flow_sigmas=objectives.sigma_distribution(vars(args)))  # fmt: skip


BASE = resolved()


def write_checkpoint(run_dir, run=None, train_config=None, step=2):
    """run_dir/checkpoints/checkpoint-STEP as choose_start reads it: trainer_state.json (with `run`
    when given) and, when given, the run's train_config.json."""
    folder = run_dir / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    state = dict(step=step, skipped_nonfinite=0) | ({} if run is None else dict(run=run))
    (folder / checkpoint.STATE_FILE).write_text(json.dumps(state))
    if train_config is not None:
        recorded = config.recorded(argparse.Namespace(**train_config))  # its settings apart, as train.py writes it
        (run_dir / "train_config.json").write_text(json.dumps(recorded, default=str))
    return folder


def resume(run_dir, config, resume_from=None):
    return rules.choose_start(run_dir, config, True, resume_from, False)


def refusal(run_dir, config, resume_from=None):
    with pytest.raises(ConfigError) as refused:
        resume(run_dir, config, resume_from)
    message = str(refused.value)
    assert "\n" not in message
    return message


def named(key):
    return key if key in DERIVED else f"--{key}"


# --- every flag is classified ---------------------------------------------------------


def test_every_flag_is_identity_or_declared_safe_to_change():
    flags = {a.dest for a in config.build_parser()._actions if a.option_strings and a.dest not in ("help", "==SUPPRESS==")}
    identity = set(rules.RUN_IDENTITY) - set(DERIVED)
    assert not flags - identity - set(SAFE), "classify these flags in rules.RUN_IDENTITY or CHANGES_ON_RESUME"
    assert not (identity | set(SAFE)) - flags, "not flags of train.py (any more)"
    assert not identity & set(SAFE) and len(SAFE) == len(set(SAFE))
    assert set(DERIVED) <= set(config.DERIVED_KEYS) and set(DERIVED) <= set(rules.RUN_IDENTITY)
    assert len(rules.RUN_IDENTITY) == len(set(rules.RUN_IDENTITY))


def test_every_identity_key_has_a_row():
    assert set(CHANGED) == set(rules.RUN_IDENTITY)


# --- one row per identity key ----------------------------------------------------------


def test_the_same_settings_resume(tmp_path):
    folder = write_checkpoint(tmp_path, rules.run_identity(BASE))
    assert resume(tmp_path, dict(BASE)) == folder


@pytest.mark.parametrize("key", CHANGED)
def test_a_changed_identity_key_is_refused_naming_it(tmp_path, key):
    assert CHANGED[key] != BASE[key]
    write_checkpoint(tmp_path, rules.run_identity(BASE))
    message = refusal(tmp_path, BASE | {key: CHANGED[key]})
    assert f"({change_words(key, BASE[key], CHANGED[key])})" in message  # that one difference, and only it


@pytest.mark.parametrize("key", CHANGED)
def test_the_change_is_refused_the_other_way_too(tmp_path, key):
    write_checkpoint(tmp_path, rules.run_identity(BASE | {key: CHANGED[key]}))
    assert change_words(key, CHANGED[key], BASE[key]) in refusal(tmp_path, BASE)


def test_all_differences_are_listed_on_one_line(tmp_path):
    write_checkpoint(tmp_path, rules.run_identity(BASE))
    message = refusal(tmp_path, BASE | dict(ema="power", class_conditional=True, num_classes=4))
    assert "--class_conditional False -> True; num_classes 0 -> 4; " in message and "--ema 'standard' -> 'power'" in message


@pytest.mark.parametrize("saved, now, refused", [("no", "bf16", False), ("bf16", "no", False), ("bf16", "fp16", True),
                                                 ("fp16", "no", True)])  # fmt: skip
def test_mixed_precision_is_compared_as_fp16_or_not(tmp_path, saved, now, refused):
    """Only fp16 adds to the checkpoint (a GradScaler's state): a bf16 run may resume in fp32 on another machine."""
    write_checkpoint(tmp_path, rules.run_identity(BASE | dict(mixed_precision=saved)))
    if refused:
        assert f"--mixed_precision {saved!r} -> {now!r}" in refusal(tmp_path, BASE | dict(mixed_precision=now))
    else:
        assert resume(tmp_path, BASE | dict(mixed_precision=now)) is not None


def test_augment_is_compared_by_its_crops_alone(tmp_path):
    """Random crops change what an epoch's images are; flips are drawn afresh each step, nothing saved."""
    write_checkpoint(tmp_path, rules.run_identity(BASE | dict(augment="flip")))
    assert resume(tmp_path, BASE | dict(augment="none")) is not None
    assert "--augment 'flip' -> 'flip,crop'" in refusal(tmp_path, BASE | dict(augment="flip,crop"))


# --- every flag declared safe, changed on a real resume: the run trains on (train.main) ----------------

# A pixel DDPM run's resume with all of these changed at once (the first run has TINY's, FEW's and the defaults).
CHANGED_ON_RESUME = [
    "--num_epochs", 5, "--max_train_steps", 4, "--lr_scheduler", "constant", "--lr_warmup_steps", 0,
    "--lr_ref_steps", 7, "--timestep_sampling", "lognormal", "--P_mean_std", "-1.0,1.4", "--snr_gamma", 5,
    "--max_grad_norm", 0.5, "--no-preload_data", "--dataloader_num_workers", 1, "--cpu", "--compile_mode", "off",
    "--logger", "tensorboard", "--save_images_epochs", 1, "--eval_batch_size", 2, "--sampler", "ddim",
    "--num_inference_steps", 2, "--guidance_scale", "1.5", "--eval_every_epochs", 1, "--eval_num_samples", 8,
    "--ema_snapshot_every", 1, "--checkpointing_steps", 1, "--checkpoints_total_limit", 2, "--on_fault", "skip",
    "--logging_steps", 1, "--profile", "kernels", "--resume",
]  # fmt: skip
# Tried elsewhere: an EDM run's (churn, below); the invocation's own (below); each with a path (added in the test);
# the data's reading again on a folder with an unreadable image (FOLDER_CHANGES, below); the VAE spelled otherwise
# (tests/test_latent_train.py, test_the_same_vae_spelled_otherwise_resumes).
FOLDER_CHANGES = ["--no-preload_data", "--dataloader_num_workers", 1]
EDM_CHANGES = ["--churn", 10]
DIT_CHANGES = ["--token_routing", "0.5"]  # a DiT's: a run trained with every token goes on routing half
WITH_A_PATH = ["guide", "fid_weights"]
INVOCATION = ["output_dir", "config", "dry_run", "overwrite_output_dir"]
ELSEWHERE = ["vae"]


def flags_of(argv):
    return {str(a).removeprefix("--").removeprefix("no-") for a in argv if str(a).startswith("--")}


def test_every_flag_declared_safe_is_tried_on_a_real_resume():
    tried = flags_of(CHANGED_ON_RESUME) | flags_of(EDM_CHANGES) | flags_of(FOLDER_CHANGES) | flags_of(DIT_CHANGES)
    tried |= set(WITH_A_PATH + INVOCATION + ELSEWHERE)
    assert tried == set(SAFE)


def trains_on(out, capsys, step, *flags, run=None):
    """train.py in `out` with `flags`: it resumes from the checkpoint of `step` (of `run`, else of `out`)
    and trains on."""
    capsys.readouterr()
    train(out, *FEW, *flags)
    stdout = capsys.readouterr().out
    assert f"resumed from {(run or out) / 'checkpoints' / f'checkpoint-{step}'} at step {step}" in stdout, stdout
    return stdout


@pytest.mark.slow
def test_a_run_resumed_with_every_safe_flag_changed_trains_on(tmp_path, capsys, monkeypatch):
    out, guide = tmp_path / "run", tmp_path / "guide"
    # DDPM runs (its --snr_gamma and --sampler ddim change below), resumed without --objective: the recorded one
    train(guide, "--max_train_steps", 2, *FEW, "--objective", "ddpm")  # a run of the same data, to guide with
    train(out, "--max_train_steps", 2, *FEW, "--compile_mode", "auto", "--objective", "ddpm")
    # Inception's weights given: FID on test_metrics' stand-in for Inception
    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    fid_weights = tmp_path / "inception.pth"
    fid_weights.touch()
    stdout = trains_on(out, capsys, 2, *CHANGED_ON_RESUME, "--guide", guide, "--fid_weights", fid_weights)
    assert re.search(r"^eval epoch 1 step 4 \| .*FID", stdout, re.M), stdout
    said = re.search(r"^resumed from .*", stdout, re.M).group(0)  # what changes the steps after it, said there
    assert all(f"--{key} " in said for key in rules.ANNOUNCED_ON_RESUME), said
    assert "--lr_scheduler 'cosine' -> 'constant'" in said and "--max_grad_norm 1.0 -> 0.5" in said, said
    assert [p.name for p in checkpoint.checkpoint_dirs(out)] == ["checkpoint-3", "checkpoint-4"]


def test_what_changed_on_resume_is_read_from_the_runs_train_config_and_nothing_without_one(tmp_path):
    start = tmp_path / "checkpoints" / "checkpoint-2"
    start.mkdir(parents=True)
    assert rules.changed_since(start, dict(lr_scheduler="constant")) == []  # no record: nothing to compare
    (tmp_path / "train_config.json").write_text(json.dumps(dict(lr_scheduler="cosine", P_mean_std=[-1.2, 1.2])))
    assert rules.changed_since(start, dict(lr_scheduler="constant", P_mean_std=(-1.2, 1.2))) == [
        "--lr_scheduler 'cosine' -> 'constant'"]  # a tuple is the list JSON holds
    (tmp_path / "train_config.json").write_text('{"lr_scheduler": ')  # damaged, or half seen on a shared disk
    assert rules.changed_since(start, dict(lr_scheduler="constant")) == []
    alone = tmp_path / "copied" / "checkpoint-2"  # a checkpoint copied out of its run: what is two up is not its record
    alone.mkdir(parents=True)
    (tmp_path / "train_config.json").write_text(json.dumps(dict(lr_scheduler="cosine")))
    assert rules.changed_since(alone, dict(lr_scheduler="constant")) == []


def test_a_folder_with_an_unreadable_image_resumed_streamed_trains_as_preloaded(tmp_path, capsys):
    """--preload_data, --dataloader_num_workers and --on_fault on a folder whose one image is unreadable: the
    run preloaded for 2 steps, resumed streamed through a worker, ends with the weights of 4 steps preloaded
    (preloading keeps the unreadable image's place as streaming does: the same batches, steps per epoch)."""
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(8):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (folder / "8.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    flags = [*FEW, "--dataset", folder, "--on_fault", "skip", "--checkpointing_steps", 2, "--save_images_epochs", 100]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *flags, "--max_train_steps", 4, "--preload_data")
    train(resumed, *flags, "--max_train_steps", 2, "--preload_data")
    trains_on(resumed, capsys, 2, *flags, "--max_train_steps", 4, *FOLDER_CHANGES)
    a, b = (tensors_of(run / "checkpoints" / "checkpoint-4")[0] for run in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    saved = [json.loads((run / "train_config.json").read_text()) for run in (straight, resumed)]
    assert saved[0]["num_images"] == saved[1]["num_images"] == 9 and saved[1]["data_path"] == "streamed"


def test_a_dit_run_resumed_with_its_tokens_routed_trains_on(tmp_path, capsys):
    out = tmp_path / "run"
    train(out, "--max_train_steps", 2, *FEW, "--model", "dit-tiny")
    said = trains_on(out, capsys, 2, "--max_train_steps", 3, "--model", "dit-tiny", *DIT_CHANGES)
    assert "(token routing: 50% of the tokens skip blocks 2-2 of 2)" in said and (out / "checkpoints" / "checkpoint-3").is_dir()


def test_an_edm_run_resumed_with_another_churn_and_no_objective_trains_on_as_edm(tmp_path, capsys):
    out = tmp_path / "run"
    train(out, "--max_train_steps", 2, *FEW, "--objective", "edm")
    trains_on(out, capsys, 2, "--max_train_steps", 3, *EDM_CHANGES)  # the objective its checkpoint recorded
    assert (out / "checkpoints" / "checkpoint-3").is_dir()
    assert json.loads((out / "train_config.json").read_text())["objective"] == "edm"


def test_the_invocations_own_flags_resume_or_start_as_they_say(tmp_path, capsys):
    out, other = tmp_path / "run", tmp_path / "other"
    train(out, "--max_train_steps", 2, *FEW)
    # another --output_dir, continuing this run's checkpoint; the run's train_config.json as --config
    trains_on(other, capsys, 2, "--max_train_steps", 3, "--resume", out / "checkpoints" / "checkpoint-2", run=out)
    trains_on(out, capsys, 2, "--config", out / "train_config.json", "--max_train_steps", 3)
    assert (other / "checkpoints" / "checkpoint-3").is_dir() and (out / "checkpoints" / "checkpoint-3").is_dir()
    config = train(out, *FEW, "--max_train_steps", 5, "--dry_run")  # describes, trains nothing
    assert config["total_train_steps"] == 5 and not (out / "checkpoints" / "checkpoint-5").exists()
    capsys.readouterr()
    train(out, *FEW, "--max_train_steps", 1, "--overwrite_output_dir")  # starts again: no resume
    assert "resumed from" not in capsys.readouterr().out
    assert [p.name for p in checkpoint.checkpoint_dirs(out)] == ["checkpoint-1"]


# --- checkpoints written before a key was checked ------------------------------------------


def old_record(config=BASE):
    """What a checkpoint written before the other keys were checked recorded of `config`: OLD_IDENTITY."""
    return {key: config[key] for key in OLD_IDENTITY}


def test_an_old_checkpoint_resumes_with_the_new_settings_at_their_defaults(tmp_path):
    folder = write_checkpoint(tmp_path, old_record())
    assert resume(tmp_path, dict(BASE)) == folder


def test_an_old_checkpoint_takes_a_missing_key_at_its_default(tmp_path):
    write_checkpoint(tmp_path, old_record())
    message = refusal(tmp_path, BASE | dict(class_conditional=True, num_classes=4))
    assert "(--class_conditional False -> True; num_classes 0 -> 4)" in message


def test_an_old_checkpoint_takes_a_missing_key_from_its_runs_train_config(tmp_path):
    """Its run's train_config.json records every flag: the EMA kind of a run from before `ema` was checked."""
    power = resolved("--ema", "power", "--ema_stds", "0.1,0.2")
    write_checkpoint(tmp_path, old_record(power), train_config=power)
    assert "(--ema 'power' -> 'standard'; --ema_stds [0.1, 0.2] -> [0.05, 0.1])" in refusal(tmp_path, BASE)
    assert resume(tmp_path, power) is not None


def test_a_missing_key_without_a_default_is_not_compared(tmp_path):
    """--learning_rate is filled from the preset (no default): an old checkpoint alone does not say it."""
    write_checkpoint(tmp_path, old_record())
    assert resume(tmp_path, BASE | dict(learning_rate=CHANGED["learning_rate"])) is not None


def test_a_checkpoint_with_no_record_at_all_resumes(tmp_path):
    write_checkpoint(tmp_path, run=None)
    assert resume(tmp_path, BASE | CHANGED) is not None


def test_resume_from_reads_the_checkpoints_own_run_not_the_output_dirs(tmp_path):
    power = resolved("--ema", "power")
    other = write_checkpoint(tmp_path / "other", old_record(power), train_config=power)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_config.json").write_text(json.dumps(BASE))
    assert "--ema 'power' -> 'standard'" in refusal(tmp_path / "run", BASE, resume_from=str(other))


# --- checkpoints of the version before issue 33, whose flags it removed or made settings ---------


@pytest.mark.parametrize("run_dir", ["default", "changed"])
def test_a_checkpoint_of_the_version_before_is_refused_in_one_line(run_dir):
    """Runs of that version (tests/fixtures/before-issue-33): their records say use_ema, sigma_data, ..."""
    folder = OLD_RUNS / run_dir / "checkpoints" / "checkpoint-1"
    assert re.fullmatch(rf"cannot resume {folder}: it was written by an earlier train.py, whose --\w+ is gone; resume "
                        rf"it with that version, or start a new run from its weights with --init_from {folder}",
                        refusal(OLD_RUNS / run_dir, BASE))  # fmt: skip


@pytest.mark.parametrize("old", [dict(use_ema=False), dict(sigma_data=0.5)])
def test_a_record_of_a_removed_flag_or_a_setting_is_refused(tmp_path, old):
    write_checkpoint(tmp_path, rules.run_identity(BASE) | old)
    assert f"whose --{next(iter(old))} is gone" in refusal(tmp_path, BASE)


# --- train.py: one line, exit code 2 ------------------------------------------------------

# 2 steps of 4 images, a grid of 1 image in 1 sampling step at the end
FEW = ["--shapes_num_images", 8, "--train_batch_size", 4, "--eval_batch_size", 1, "--num_inference_steps", 1,
       "--logger", "none"]  # fmt: skip


@pytest.mark.parametrize("added, says", [(["--ema", "power"], "--ema 'standard' -> 'power'"),
                                         (["--class_conditional"], "--class_conditional False -> True")])  # fmt: skip
def test_train_refuses_a_resume_that_adds_a_flag_in_one_line(tmp_path, capsys, added, says):
    out = tmp_path / "run"
    train(out, "--max_train_steps", 2, *FEW)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        train(out, "--max_train_steps", 4, *FEW, *added)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("train.py: error: cannot resume") and says in err, err
    assert "Traceback" not in err


def test_a_resume_that_names_no_objective_keeps_the_one_its_checkpoint_recorded(tmp_path):
    """The preset's default objective may change between releases; the run a checkpoint holds may not."""
    run_dir = tmp_path / "run"
    flow = resolved("--objective", "flow")
    write_checkpoint(run_dir, dict(objective="flow"), train_config=flow)
    args = lambda *flags: config.parse_args([*TINY, "--output_dir", str(run_dir), *flags])  # noqa: E731
    kept = args()
    assert rules.keep_recorded_objective(kept) == "flow" and kept.objective == "flow"
    assert resume(run_dir, resolved("--objective", kept.objective)) is not None  # and resuming it is not refused
    for flags, objective in ((["--objective", "edm"], "edm"), (["--overwrite_output_dir"], None), (["--no-resume"], None)):
        given = args(*flags)
        assert rules.keep_recorded_objective(given) is None and given.objective == objective
    edm = str(write_checkpoint(tmp_path / "other", dict(objective="edm")))
    assert rules.keep_recorded_objective(args("--resume", edm)) == "edm"  # --resume CHECKPOINT: that checkpoint's run
    assert rules.keep_recorded_objective(args("--resume", edm, "--overwrite_output_dir")) == "edm"  # as choose_start: it wins
    empty = config.parse_args([*TINY, "--output_dir", str(tmp_path / "empty")])
    assert rules.keep_recorded_objective(empty) is None and empty.objective is None  # a fresh run: the preset's


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.bin", "random_states_0.pkl", checkpoint.STATE_FILE])
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_one_before_it(tmp_path, capsys, damaged):
    """A file of the newest checkpoint cut short (a copy between nodes that stopped, a disk's fault): one line that
    names it and the checkpoint to resume instead, every checkpoint kept; that one resumes."""
    out = tmp_path / "run"
    train(out, "--max_train_steps", 4, "--checkpointing_steps", 2, *FEW)
    newest, before = out / "checkpoints" / "checkpoint-4", out / "checkpoints" / "checkpoint-2"
    (newest / damaged).write_bytes((newest / damaged).read_bytes()[:40])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        train(out, "--max_train_steps", 6, *FEW)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"train.py: error: cannot load checkpoint {newest} (") and "from the one before it, checkpoint-2" in err, err
    assert checkpoint.checkpoint_dirs(out) == [before, newest]
    newest.rename(tmp_path / "damaged")  # as the line says
    trains_on(out, capsys, 2, "--max_train_steps", 6)


def test_resuming_an_older_checkpoint_where_newer_ones_are_is_refused_in_one_line(tmp_path, capsys):
    """Going back to step 2 in a folder that holds step 4: the new steps would sit among the old ones (and a
    --checkpoints_total_limit would delete each new one as it is saved); another --output_dir takes it."""
    out = tmp_path / "run"
    train(out, "--max_train_steps", 4, "--checkpointing_steps", 2, *FEW)
    before = out / "checkpoints" / "checkpoint-2"
    with pytest.raises(ConfigError, match=r"holds newer checkpoints \(checkpoint-4\): --resume alone continues"):
        rules.choose_start(out, BASE, True, str(before), False)
    trains_on(tmp_path / "back", capsys, 2, "--max_train_steps", 3, "--resume", before, run=out)


def test_a_damaged_only_checkpoint_says_how_to_start_again(tmp_path):
    (tmp_path / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "checkpoint-2" / checkpoint.STATE_FILE).write_text('{"step": ')
    with pytest.raises(ConfigError, match=r"cannot load checkpoint .*checkpoint-2 \(JSONDecodeError: .*--overwrite_output_dir"):
        checkpoint.read_state(tmp_path / "checkpoints" / "checkpoint-2")
