"""config.py: flags declared once, resolve() fills and checks, --config files, the shipped configs/."""

import copy
import glob
import json
import time

import pytest
import yaml

import config
import train
from conftest import ROOT
from errors import ConfigError
from test_train import TINY, run, visible

SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def resolved(*argv):
    return config.resolve(config.parse_args([*map(str, argv)]))


def one_line_error(capsys, argv):
    """parse_args (and resolve) of argv must stop with exit code 2 and one line on stderr: that line."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args([*map(str, argv)]))
    assert exit_info.value.code == 2
    err = visible(capsys.readouterr().err)
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_the_reference_runs_are_shipped():
    names = {p.name for p in SHIPPED}
    assert {"butterflies128.yaml", "cifar10-ddpm32.yaml"} <= names
    assert {f"cifar10-edm2-{c}.yaml" for c in "CEG"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_each_shipped_config_dry_runs_without_opening_its_dataset(tmp_path, capsys, path):
    text = path.read_text()
    assert text.startswith("# ") and "python train.py --config configs/" in text  # a header: what, whence, how
    # tests run with HF_HUB_OFFLINE=1: a dry run that reached for its Hub dataset would fail
    out = tmp_path / "out"
    settings = train.main(train.parse_args(["--config", str(path), "--dry_run", "--output_dir", str(out)]))
    assert "parameters" in capsys.readouterr().out and not out.exists()
    for key, value in yaml.safe_load(text).items():
        if key != "output_dir":
            assert settings[key] == pytest.approx(value) if isinstance(value, float) else settings[key] == value, key


def test_a_runs_train_config_json_resolves_to_the_same_configuration(tmp_path):
    argv = [*TINY, "--output_dir", tmp_path / "run", "--max_train_steps", 1, "--checkpointing_steps", 100,
            "--save_images_epochs", 100, "--lr_scheduler", "inverse_sqrt", "--ema", "power", "--no-random_flip",
            "--logger", "none"]  # fmt: skip
    train.main(train.parse_args([*map(str, argv)]))
    assert not (tmp_path / "run" / "logs").exists()  # --logger none: no tensorboard logs
    saved = tmp_path / "run" / "train_config.json"
    again = vars(resolved("--config", saved))
    first = vars(resolved(*argv))
    assert again.pop("config") == str(saved) and first.pop("config") is None
    assert again == first
    assert first["lr_ref_steps"] == config.DEFAULT_LR_REF_STEPS and first["ema_stds"] == [0.05, 0.1]  # filled, read back


def test_a_flag_on_the_command_line_overrides_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train_batch_size: 4\nlearning_rate: 1e-3\nuse_ema: false\ncpu: true\nema_stds: [0.05, 0.08]\n")
    from_file = resolved("--config", path)
    assert (from_file.train_batch_size, from_file.learning_rate, from_file.use_ema, from_file.cpu) == (4, 1e-3, False, True)
    assert from_file.ema_stds == [0.05, 0.08]
    # typed flags win, even when they say the default (16, --use_ema) or undo a switch (--no-cpu)
    typed = resolved("--config", path, "--train_batch_size", 16, "--use_ema", "--no-cpu")
    assert (typed.train_batch_size, typed.learning_rate, typed.use_ema, typed.cpu) == (16, 1e-3, True, False)
    # JSON too, and the flags may come before --config
    (tmp_path / "run.json").write_text(json.dumps(dict(model="tiny", image_size=16)))
    assert resolved("--image_size", 32, "--config", tmp_path / "run.json").image_size == 32


BAD_FILES = [
    ("trian_batch_size: 8\n", "--config {path}: 'trian_batch_size' is not a flag of train.py"),
    ("profile_operators: true\n", "profile_operators is now --profile operators"),
    ("train_batch_size: many\n", "--config {path}: argument --train_batch_size: invalid int value: 'many'"),
    ("use_ema: 2\n", "--config {path}: use_ema takes true or false (got 2)"),
    ("[1, 2]\n", "--config {path}: holds a list"),
    ("a: [\n", "--config {path}: not valid YAML"),
    ("train_batch_size: 0\n", "--train_batch_size must be at least 1 (got 0)"),  # a range: checked by resolve
]


@pytest.mark.parametrize("text, message", BAD_FILES, ids=[m.split(": ")[-1] for _, m in BAD_FILES])
def test_a_bad_config_file_is_one_line_and_exit_code_2(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = one_line_error(capsys, ["--config", path, "--output_dir", tmp_path / "out"])
    assert line.startswith("train.py: error: ") and message.format(path=path) in line, line
    assert not (tmp_path / "out").exists()


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    assert "cannot read it" in one_line_error(capsys, ["--config", tmp_path / "nope.yaml"])


@pytest.mark.parametrize("old, new", [(["--profile", "--profile_operators"], "--profile operators"),
                                      (["--profile", "--no-profile_operators"], "--profile (its level")])  # fmt: skip
def test_a_removed_flag_names_its_new_spelling(capsys, old, new):
    line = one_line_error(capsys, old)
    assert line.startswith(f"train.py: error: {old[-1]} is now {new}"), line


def test_profile_takes_its_level_and_profile_only_implies_it():
    assert resolved().profile is None
    assert resolved("--profile").profile == "kernels"
    assert resolved("--profile", "operators").profile == "operators"
    assert resolved("--profile_only").profile == "kernels"


@pytest.mark.parametrize(
    "argv",
    [[], ["--model", "edm2tiny", "--image_size", 16], ["--image_size", 128, "--profile_only"],
     ["--lr_scheduler", "inverse_sqrt", "--ema", "power", "--ema_stds", "0.05,0.1"]],
)  # fmt: skip
def test_resolve_fills_everything_and_is_idempotent(argv):
    once = resolved(*argv)
    twice = config.resolve(copy.deepcopy(once))
    assert vars(twice) == vars(once)
    unset = ("model", "objective", "learning_rate", "lr_scheduler", "num_inference_steps", "mixed_precision",
             "channels_last", "compile", "cudnn_benchmark", "fused_norm")  # fmt: skip
    assert all(getattr(once, name) is not None for name in unset) and once.model != "auto"
    assert (once.lr_ref_steps is not None) == (once.lr_scheduler == "inverse_sqrt")


def test_lr_ref_steps_counts_the_processes(monkeypatch):
    # edm2tiny: 1000 reference images; 8 images a process and step
    argv = ["--model", "edm2tiny", "--image_size", 16, "--train_batch_size", 8]
    assert resolved(*argv).lr_ref_steps == 1000 // 8
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolved(*argv).lr_ref_steps == 1000 // 32
    assert resolved(*argv, "--lr_ref_steps", 7).lr_ref_steps == 7
    assert resolved("--lr_scheduler", "inverse_sqrt").lr_ref_steps == config.DEFAULT_LR_REF_STEPS  # no reference


def test_every_range_is_checked_with_the_flags_name():
    with pytest.raises(ConfigError, match=r"^--adam_beta1 must be in \[0, 1\) \(got 1.0\)$"):
        resolved("--adam_beta1", 1)
    with pytest.raises(ConfigError, match=r"^--weight_decay must be at least 0 \(got -1.0\)$"):
        resolved("--weight_decay=-1")
    with pytest.raises(ConfigError, match=r"^--P_std must be greater than 0 \(got 0.0\)$"):
        resolved("--P_std", 0)
    text = " ".join(config.build_parser().format_help().split())
    assert "images per device per micro-batch (at least 1; default: the preset's; 4 for small, else 16)" in text
    assert "AdamW weight decay (at least 0; default: 1e-06)" in text


def test_logger_wandb_logs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run(out, "--max_train_steps", 2, "--logging_steps", 1, "--checkpointing_steps", 100, "--save_images_epochs", 100,
        "--logger", "wandb")  # fmt: skip
    (log,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(60):  # wandb's service may still be writing the file when finish() returns (seen under load)
        records = open(log, "rb").read()
        if b"loss" in records and b'"tiny"' in records:
            break
        time.sleep(0.5)
    assert b"loss" in records and b'"tiny"' in records  # the scalars and the configuration
    assert not (out / "logs").exists()  # no tensorboard beside it


def test_a_file_never_carries_what_one_command_asked_for_once(tmp_path):
    """A run started with --overwrite_output_dir, fed back, resumes rather than deleting its checkpoints."""
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps(dict(model="tiny", overwrite_output_dir=True, resume_from_checkpoint="latest", dry_run=True)))
    args = resolved("--config", path)
    assert (args.model, args.overwrite_output_dir, args.resume_from_checkpoint, args.dry_run) == ("tiny", False, None, False)
    assert resolved("--config", path, "--overwrite_output_dir").overwrite_output_dir  # typed: still honoured


def test_docs_cli_md_is_the_help_of_these_flags():
    assert (ROOT / "docs" / "cli.md").read_text() == config.cli_markdown(), "run: python config.py docs/cli.md"


@pytest.fixture
def gpu_machine(monkeypatch):
    """resolve() as on a machine with a bf16 CUDA GPU."""
    monkeypatch.setattr(config.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config.torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_cpu_on_a_gpu_machine_trains_in_fp32_uncompiled(gpu_machine):
    on_cpu = resolved("--cpu")
    assert (on_cpu.mixed_precision, on_cpu.compile, on_cpu.cudnn_benchmark) == ("no", False, False)
    assert resolved().mixed_precision == "bf16"
    assert "drop --cpu" in str(pytest.raises(ConfigError, resolved, "--cpu", "--mixed_precision", "fp16").value)


def test_the_bare_run_on_a_gpu_fills_it(gpu_machine):
    bare = resolved()
    for name, value in config.GPU_BARE_RUN.items():
        assert getattr(bare, name) == value, name
    assert config.resolve(copy.deepcopy(bare)) == bare  # idempotent
    # What the command line says wins; other data, sizes, models and --cpu keep the CPU's bare run.
    assert (resolved("--train_batch_size", 64).train_batch_size, resolved("--shapes_num_images", 99).shapes_num_images) == (64, 99)
    assert resolved("--objective", "edm").prediction_type == "epsilon"  # DDPM's settings are left out
    for argv in (["--cpu"], ["--model", "small"], ["--image_size", 16], ["--dataset", "some/folder"]):
        other = resolved(*argv)
        assert other.train_batch_size != 128 and other.shapes_num_images == config.CPU_SHAPES_NUM_IMAGES, argv
    assert resolved("--cpu").model == "small"
