"""config.py: flags declared once, resolve() fills and checks, --config files, the shipped configs/."""

import copy
import glob
import json
import re
import time

import pytest
import yaml

from ddpm_train.training import checkpoint
from ddpm_train import config
from ddpm_train.data import data
import train
from bench import speed
from conftest import ROOT
from ddpm_train.errors import ConfigError
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
            "--save_images_epochs", 100, "--lr_scheduler", "inverse_sqrt", "--ema", "power", "--augment", "crop",
            "--no-preload_data", "--logger", "none"]  # fmt: skip
    train.main(train.parse_args([*map(str, argv)]))
    assert not (tmp_path / "run" / "logs").exists()  # --logger none: no tensorboard logs
    saved = tmp_path / "run" / "train_config.json"
    # it records today's flags, a --config file's keys, the facts of the run and, apart, the settings: nothing removed
    written = json.loads(saved.read_text())
    flags = {a.dest for a in config.build_parser()._actions if a.option_strings}
    assert not set(written) - flags - {*config.DERIVED_KEYS, *config.FILE_KEYS, "settings"}, "neither a flag nor a fact of the run"
    assert not set(written) & set(config.REMOVED) and not set(written) & set(config.SETTING_NAMES)
    assert written["settings"] == {name: getattr(resolved(*argv), name) for name in config.SETTING_NAMES}
    again = vars(resolved("--config", saved))
    first = vars(resolved(*argv))
    assert again.pop("config") == str(saved) and first.pop("config") is None
    assert again == first
    assert first["lr_ref_steps"] == config.DEFAULT_LR_REF_STEPS and first["ema_stds"] == [0.05, 0.1]  # filled, read back


def test_a_flag_on_the_command_line_overrides_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train_batch_size: 4\nlearning_rate: 1e-3\nema: none\ncpu: true\nema_stds: [0.05, 0.08]\n"
                    "class_conditional: label\n")
    from_file = resolved("--config", path)
    assert (from_file.train_batch_size, from_file.learning_rate, from_file.ema, from_file.cpu) == (4, 1e-3, "none", True)
    assert from_file.ema_stds == [0.05, 0.08] and from_file.class_conditional == "label"
    # typed flags win, even when they say the default (16, --ema standard) or undo a switch (--no-cpu)
    typed = resolved("--config", path, "--train_batch_size", 16, "--ema", "standard", "--no-cpu", "--class_conditional")
    assert (typed.train_batch_size, typed.learning_rate, typed.ema, typed.cpu) == (16, 1e-3, "standard", False)
    assert typed.class_conditional is True
    # JSON too, and the flags may come before --config
    (tmp_path / "run.json").write_text(json.dumps(dict(model="tiny", image_size=16)))
    assert resolved("--image_size", 32, "--config", tmp_path / "run.json").image_size == 32


BAD_FILES = [
    ("trian_batch_size: 8\n", "--config {path}: 'trian_batch_size' is not a flag of train.py"),
    ("profile_operators: true\n", "--config {path}: 'profile_operators' is not a flag of train.py"),  # gone before issue 33
    ("train_batch_size: many\n", "--config {path}: argument --train_batch_size: invalid int value: 'many'"),
    ("cpu: 2\n", "--config {path}: cpu takes true or false (got 2)"),
    ("[1, 2]\n", "--config {path}: holds a list"),
    ("a: [\n", "--config {path}: not valid YAML"),
    ("train_batch_size: 0\n", "--train_batch_size must be at least 1 (got 0)"),  # a range: checked by resolve
    # what a run's train_config.json records and must not act on again, a file of yours asks for in vain
    ("resume: true\n", "--config {path}: 'resume' acts only when typed: pass --resume on the command line"),
    ("overwrite_output_dir: true\n", "--config {path}: 'overwrite_output_dir' acts only when typed"),
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
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00model")
    assert "not a text file" in one_line_error(capsys, ["--config", tmp_path / "binary.yaml"])


@pytest.mark.parametrize("where", ["file", "under_file", "read_only"])
def test_an_output_dir_that_cannot_be_written_is_one_line_before_any_data(tmp_path, capsys, monkeypatch, where):
    """A file at --output_dir or on its path, or a folder the run cannot write in: refused before the data loads
    and the network is built, not a traceback at the first file written."""
    (tmp_path / "a_file").touch()
    out = {"file": tmp_path / "a_file", "under_file": tmp_path / "a_file" / "run", "read_only": tmp_path / "ro" / "run"}
    if where == "read_only":  # root writes through chmod: the mount's refusal as os.access reports it
        (tmp_path / "ro").mkdir()
        monkeypatch.setattr(checkpoint.os, "access", lambda path, mode: path != tmp_path / "ro")
    monkeypatch.setattr(data, "load_images", lambda *a: pytest.fail("loaded the data"))
    line = one_line_error(capsys, [*TINY, "--output_dir", out[where]])
    says = "cannot write in" if where == "read_only" else "is a file, not a folder"
    assert line.startswith(f"train.py: error: --output_dir {out[where]}: ") and says in line, line


@pytest.mark.parametrize("key", config.REMOVED)
def test_a_removed_flag_on_the_command_line_names_what_replaced_it(capsys, key):
    words = [f"--{key}", "1"] if key != "resume_from_checkpoint" else [f"--{key}", "latest"]
    line = one_line_error(capsys, words)
    assert line == f"train.py: error: --{key} was removed: {config.REMOVED[key]} (see --help)", line
    assert f"--no-{key} was removed: " in one_line_error(capsys, [f"--no-{key}"])


@pytest.mark.parametrize("key", config.SPEED_SETTINGS)
def test_a_removed_speed_flag_names_the_flag_of_python_m_bench_that_sets_it(capsys, key):
    line = one_line_error(capsys, [f"--{key}"])
    named = re.search(r"the rows of python -m bench and its (--[\w-]+) set it on the step they time", line)
    assert named and "bench.py" not in line, line
    assert speed.parse_args([named.group(1)]).train_settings  # a flag of python -m bench, setting one of these


def test_a_pair_starting_negative_is_a_value_not_a_flag():
    assert resolved("--P_mean_std", "-1.0,1.4").P_mean_std == [-1.0, 1.4]  # no '=' needed


def test_a_switch_with_a_value_takes_none_in_its_no_form(capsys):
    assert data.label_column_of(resolved("--class_conditional", "label")) == "label"
    assert one_line_error(capsys, ["--no-resume", "old/checkpoint"]).startswith(
        "train.py: error: --no-resume takes no value (got 'old/checkpoint')")  # fmt: skip


def test_guidance_needs_labels_or_a_guide(capsys):
    assert resolved("--class_conditional", "--guidance_scale", "1,2").guidance_scale == [1.0, 2.0]
    assert "--guidance_scale guides a --class_conditional or --text_encoder run (or one with --guide)" in one_line_error(
        capsys, ["--guidance_scale", "1,2", "--dry_run"])  # fmt: skip


def test_removed_prefixes_of_flags_are_not_abbreviations(capsys):
    """argparse would read --compile as --compile_mode and --P_mean as --P_mean_std: with values the long
    flags take, they are one-line errors that name the removed flag."""
    for old, value in (("--compile", "default"), ("--P_mean", "-1,1.2")):
        assert f"{old} was removed" in one_line_error(capsys, [f"{old}={value}", "--dry_run"])


OLD_RUNS = ROOT / "tests" / "fixtures" / "before-issue-33"


@pytest.mark.parametrize("text, key", [("use_ema: false\n", "use_ema"), ("seed: 1\ncenter_crop: true\n", "center_crop")])
def test_a_removed_key_in_a_file_is_one_line_naming_what_replaced_it(tmp_path, capsys, text, key):
    path = tmp_path / "old.yaml"
    path.write_text(text)
    line = one_line_error(capsys, ["--config", path, "--output_dir", tmp_path / "out"])
    assert line.startswith(f"train.py: error: --config {path}: '{key}' was removed: {config.REMOVED[key]}"), line


def test_an_old_runs_train_config_json_is_refused_in_one_line_and_a_runs_settings_are_left(tmp_path, capsys):
    """A run of the version before issue 33 (tests/fixtures/before-issue-33/README.md) recorded use_ema, ...;
    today's runs record their settings apart, which a file read back leaves: today's train.py does them."""
    path = OLD_RUNS / "changed" / "train_config.json"
    assert "was removed: " in one_line_error(capsys, ["--config", path, "--output_dir", tmp_path / "out"])
    (tmp_path / "run.json").write_text(json.dumps(dict(seed=3, settings=dict(sigma_data=0.25, channels_last=True))))
    args = resolved("--config", tmp_path / "run.json")
    assert args.seed == 3 and args.sigma_data == 0.5 and args.channels_last is False


@pytest.mark.parametrize(
    "argv",
    [[], ["--model", "edm2tiny", "--image_size", 16], ["--image_size", 128, "--profile"],
     ["--lr_scheduler", "inverse_sqrt", "--ema", "power", "--ema_stds", "0.05,0.1"]],
)  # fmt: skip
def test_resolve_fills_everything_and_is_idempotent(argv):
    once = resolved(*argv)
    twice = config.resolve(copy.deepcopy(once))
    assert vars(twice) == vars(once)
    unset = ("model", "objective", "learning_rate", "lr_scheduler", "num_inference_steps", "mixed_precision",
             "ema", "compile_mode", "P_mean_std", *config.SETTINGS, *config.SPEED_SETTINGS)  # fmt: skip
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
    with pytest.raises(ConfigError, match=r"^--adam_betas must be two numbers in \[0, 1\) \(got \[0.9, 1.0\]\)$"):
        resolved("--adam_betas", "0.9,1")
    with pytest.raises(ConfigError, match=r"^--weight_decay must be a finite number, at least 0 \(got -1.0\)$"):
        resolved("--weight_decay=-1")
    with pytest.raises(ConfigError, match=r"^--learning_rate must be a finite number greater than 0 \(got inf\)$"):
        resolved("--learning_rate", "inf")
    with pytest.raises(ConfigError, match=r"^--seed must be in \[0, 4294967295\] \(numpy's seeds\) \(got 4294967296\)$"):
        resolved("--seed", 2**32)
    with pytest.raises(ConfigError, match=r"^--P_mean_std must be two numbers, P_std greater than 0 \(got \[-1.0, 0.0\]\)$"):
        resolved("--P_mean_std=-1,0")
    with pytest.raises(ConfigError, match=r"^--preload_data must be a finite number greater than 0 \(got 0.0\)$"):
        resolved("--preload_data", 0)
    text = " ".join(config.build_parser().format_help().split())
    assert "images per device per micro-batch (at least 1; default: the preset's; 4 for small, else 16)" in text
    assert "AdamW weight decay (a finite number, at least 0; default: 1e-06)" in text


@pytest.mark.slow
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
    path.write_text(json.dumps(dict(model="tiny", overwrite_output_dir=True, resume="run/checkpoints/checkpoint-4",
                                    resume_from_checkpoint="latest", dry_run=True, total_train_steps=4)))  # a run's facts
    args = resolved("--config", path)
    assert (args.model, args.overwrite_output_dir, args.resume, args.dry_run) == ("tiny", False, True, False)
    assert resolved("--config", path, "--overwrite_output_dir").overwrite_output_dir  # typed: still honoured


def test_docs_cli_md_is_the_help_of_these_flags():
    assert (ROOT / "docs" / "cli.md").read_text() == config.cli_markdown(), "run: python -m ddpm_train.config docs/cli.md"


@pytest.fixture
def gpu_machine(monkeypatch):
    """resolve() as on a machine with a bf16 CUDA GPU."""
    monkeypatch.setattr(config.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config.torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_cpu_on_a_gpu_machine_trains_in_fp32_uncompiled(gpu_machine):
    on_cpu = resolved("--cpu")
    assert (on_cpu.mixed_precision, on_cpu.compile_mode, on_cpu.cudnn_benchmark) == ("no", "off", False)
    assert resolved().mixed_precision == "bf16"
    assert "drop --cpu" in str(pytest.raises(ConfigError, resolved, "--cpu", "--mixed_precision", "fp16").value)


def test_the_bare_run_on_a_gpu_fills_it(gpu_machine):
    bare = resolved()
    assert bare.objective == "ddpm"  # a UNet on the built-in shapes (config.default_objective)
    for name, value in config.GPU_BARE_RUN.items():
        assert getattr(bare, name) == value, name
    assert config.resolve(copy.deepcopy(bare)) == bare  # idempotent
    # What the command line says wins; other data, sizes, models and --cpu keep the CPU's bare run.
    assert (resolved("--train_batch_size", 64).train_batch_size, resolved("--shapes_num_images", 99).shapes_num_images) == (64, 99)
    assert resolved("--objective", "edm").prediction_type == "epsilon"  # DDPM's settings are left out
    for argv in (["--cpu"], ["--model", "small"], ["--image_size", 16], ["--dataset", "./some/folder"]):
        other = resolved(*argv)
        assert other.train_batch_size != 128 and other.shapes_num_images == config.CPU_SHAPES_NUM_IMAGES, argv
    assert resolved("--cpu").model == "small"


def test_the_default_objective_is_flow_on_real_images_and_ddpm_for_a_unet_on_the_shapes():
    objective = lambda *argv: resolved(*argv).objective  # noqa: E731
    assert objective() == "ddpm"  # the bare run: a UNet on the built-in shapes draws them cleaner with DDPM
    assert objective("--dataset", "photos/") == "flow" and objective("--dataset", "photos/", "--model", "ref128") == "flow"
    assert objective("--model", "dit-small") == "flow"  # a DiT: flow on the shapes too
    assert objective("--model", "edm2tiny", "--image_size", 16) == objective("--model", "edm2tiny", "--image_size", 16,
                                                                             "--dataset", "photos/") == "edm"  # fmt: skip
    assert objective("--dataset", "photos/", "--objective", "ddpm") == "ddpm"  # asked for


def test_decoding_workers_default_to_the_cores_this_process_may_use(monkeypatch):
    """A SLURM job or `taskset` gives a process fewer cores than the machine has: more workers than those only contend."""
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert config.parse_args([]).dataloader_num_workers == 1
