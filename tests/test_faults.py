"""Fault injection: preemption, kills during a save, NaNs, bad images, a full disk, and refusals."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import flops
import model as models
import train
from conftest import ROOT

TINY = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "32", "--train_batch_size", "4",
    "--num_inference_steps", "2", "--eval_batch_size", "1", "--lr_warmup_steps", "2",
    "--dataloader_num_workers", "0", "--timing_warmup_steps", "0", "--save_images_epochs", "100",
    "--max_train_steps", "6", "--checkpointing_steps", "2",
]  # fmt: skip


def flags(output_dir, *extra):
    return [*TINY, "--output_dir", str(output_dir), *map(str, extra)]


def run(output_dir, *extra):
    return train.main(train.parse_args(flags(output_dir, *extra)))


def exit_code(output_dir, *extra):
    with pytest.raises(SystemExit) as stopped:
        run(output_dir, *extra)
    return stopped.value.code


def weights(run_dir):
    return load_file(run_dir / "unet" / "diffusion_pytorch_model.safetensors")


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def checkpoints(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every interrupted one must match."""
    out = tmp_path_factory.mktemp("straight")
    run(out)
    return out


def send_at_step(monkeypatch, step, *signals):
    """Deliver real signals to this process right after training step `step` ends."""
    done = flops.StepTimer.step_done

    def step_done(self):
        done(self)
        if self.steps_seen == step:
            for sig in signals:
                os.kill(os.getpid(), sig)

    monkeypatch.setattr(flops.StepTimer, "step_done", step_done)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_exits_and_the_same_command_resumes_exactly(tmp_path, monkeypatch, capsys, straight, sig, code):
    out = tmp_path / "run"
    send_at_step(monkeypatch, 3, sig)
    assert exit_code(out) == code
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-3"]  # step 3 is kept, not lost
    assert f"stopped by {signal.Signals(sig).name} at step 3" in capsys.readouterr().out
    monkeypatch.undo()

    run(out)  # the same command again continues the run
    assert "resumed from" in capsys.readouterr().out
    assert_same_weights(out, straight)


def test_a_second_ctrl_c_exits_at_once_without_saving(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    send_at_step(monkeypatch, 3, signal.SIGINT, signal.SIGINT)
    assert exit_code(out) == 130
    assert checkpoints(out) == ["checkpoint-2"]
    assert "interrupted twice" in capsys.readouterr().err


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import torch, checkpoint, train
where = {where!r}
if where == "between accelerate's files":  # the model is written, the optimizer is not
    real_save = torch.save
    def save(*args, **kwargs):
        if "checkpoint-4" in str(args[1]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(*args, **kwargs)
    torch.save = save
else:  # every file written, the rename not yet done
    real_fsync = checkpoint._fsync_tree
    def fsync(folder):
        real_fsync(folder)
        if "checkpoint-4" in str(folder):
            os.kill(os.getpid(), signal.SIGKILL)
    checkpoint._fsync_tree = fsync
train.main(train.parse_args(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["between accelerate's files", "before the rename"])
def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, straight, where):
    out = tmp_path / "run"
    script = KILLER.format(root=str(ROOT), where=where)
    killed = subprocess.run([sys.executable, "-c", script, *flags(out)], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # the half-written one is only a hidden temporary folder; 'latest' is checkpoint-2
    assert checkpoints(out) == [".tmp-checkpoint-4", "checkpoint-2", "checkpoint-3"] or checkpoints(out) == [
        ".tmp-checkpoint-4",
        "checkpoint-2",
    ]
    run(out)
    assert_same_weights(out, straight)
    assert ".tmp-checkpoint-4" not in checkpoints(out)


def inject_nan_at_call(monkeypatch, call):
    real, calls = models.ddpm_loss, []

    def loss(*args, **kwargs):
        calls.append(1)
        value = real(*args, **kwargs)
        return value * float("nan") if len(calls) == call else value

    monkeypatch.setattr(models, "ddpm_loss", loss)


def adam_steps(checkpoint_dir):
    state = torch.load(checkpoint_dir / "optimizer.bin", weights_only=False)["state"]
    return {int(s["step"]) for s in state.values()}


def test_nonfinite_skip_leaves_the_weights_alone_and_counts(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    inject_nan_at_call(monkeypatch, 3)
    run(out)
    assert "skipped 1 step(s) with a non-finite loss or gradient" in capsys.readouterr().out
    final = out / "checkpoints" / "checkpoint-6"
    assert json.loads((final / "trainer_state.json").read_text())["skipped_nonfinite"] == 1
    assert adam_steps(final) == {5}  # 6 steps, one of them skipped entirely
    assert all(torch.isfinite(w).all() for w in weights(out).values())


def test_nonfinite_stop_exits_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    inject_nan_at_call(monkeypatch, 3)
    assert exit_code(out, "--on_nonfinite", "stop") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error: non-finite loss or gradient at step 3 (--on_nonfinite stop)")
    assert checkpoints(out) == ["checkpoint-2"]
    assert adam_steps(out / "checkpoints" / "checkpoint-2") == {2}


def write_folder(folder, good=8, corrupt=("bad.png",)):
    folder.mkdir(parents=True)
    for i in range(good):
        Image.new("RGB", (20, 20), (30 * i, 100, 50)).save(folder / f"img{i}.png")
    for name in corrupt:
        (folder / name).write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return folder


@pytest.mark.parametrize("preload", ["--preload_data", "--no-preload_data"])
def test_a_corrupt_image_is_skipped_with_a_warning_and_counted(tmp_path, capsys, preload):
    images = write_folder(tmp_path / "images")
    run(tmp_path / "run", "--dataset", images, preload, "--max_train_steps", 4)
    captured = capsys.readouterr()
    assert f"warning: skipping cannot read image {images / 'bad.png'}" in captured.err
    assert "and 1 unreadable image(s)" in captured.out


def test_strict_data_stops_at_a_corrupt_image(tmp_path, capsys):
    images = write_folder(tmp_path / "images")
    assert exit_code(tmp_path / "run", "--dataset", images, "--strict_data") == 2
    assert "bad.png" in capsys.readouterr().err


@pytest.mark.parametrize("preload", ["--preload_data", "--no-preload_data"])
def test_a_folder_with_no_readable_image_fails_before_training(tmp_path, capsys, preload):
    images = write_folder(tmp_path / "images", good=0, corrupt=("a.png", "b.jpg"))
    assert exit_code(tmp_path / "run", "--dataset", images, preload) == 2
    assert "none of the 2 images could be read" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch, capsys):
    from accelerate import Accelerator

    real = Accelerator.save_state

    def save_state(self, output_dir=None, **kwargs):
        if "checkpoint-4" in str(output_dir):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    out = tmp_path / "run"
    assert exit_code(out) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "could not write checkpoint" in err and "the disk is full" in err and "checkpoint-2, is intact" in err
    assert checkpoints(out) == ["checkpoint-2"]


def test_resuming_with_other_settings_is_refused_with_the_differences(tmp_path, capsys):
    out = tmp_path / "run"
    run(out, "--max_train_steps", 2)
    capsys.readouterr()
    assert exit_code(out, "--train_batch_size", 8, "--seed", 1) == 2
    err = capsys.readouterr().err.strip()
    assert "--train_batch_size 4 -> 8" in err and "--seed 0 -> 1" in err and len(err.splitlines()) == 1


def test_a_finished_run_is_not_trained_again_and_longer_runs_continue(tmp_path, capsys):
    out = tmp_path / "run"
    run(out, "--max_train_steps", 4)
    run(out, "--max_train_steps", 4)
    assert "already trained to step 4 of 4" in capsys.readouterr().out
    capsys.readouterr()
    run(out)  # 6 steps: continues from 4 (on a schedule stretched to 6, so not the straight run's weights)
    assert "checkpoint-4 at step 4" in capsys.readouterr().out
    assert checkpoints(out)[-1] == "checkpoint-6"


def test_another_runs_output_dir_is_not_overwritten_without_the_flag(tmp_path, capsys):
    out = tmp_path / "run"
    run(out, "--max_train_steps", 2)
    assert exit_code(out, "--no-resume") == 2
    assert "--overwrite_output_dir" in capsys.readouterr().err
    run(out, "--no-resume", "--overwrite_output_dir", "--max_train_steps", 1, "--checkpointing_steps", 10)
    assert checkpoints(out) == ["checkpoint-1"]


# accelerate's --cpu launcher starts one process; --multi_gpu starts torchrun, and
# train.py --cpu makes the processes use gloo on the CPU.
TWO_PROCESSES = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                 "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "train.py", "--cpu"]  # fmt: skip


def run_two_processes(*flags, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([*TWO_PROCESSES, *map(str, flags)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_processes_train_checkpoint_resume_and_write_once(tmp_path):
    out = tmp_path / "run"
    # class-conditional: the labels are split between the processes with their images (tests/test_labels.py)
    common = [*flags(out), "--save_images_epochs", 1, "--logging_steps", 2, "--class_conditional"]
    first = run_two_processes(*common, "--max_train_steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_two_processes(*common)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and second.stdout.count("resumed from") == 1  # printed by rank 0 only
    # global batch: 4 per process x 2 processes -> 32 images make 4 steps an epoch
    config = json.loads((out / "train_config.json").read_text())
    assert config["num_processes"] == 2 and config["global_batch_size"] == 8 and config["steps_per_epoch"] == 4
    assert config["class_names"] == ["circle", "square", "triangle"] and sum(config["class_counts"]) == 32
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["0000.png", "0001.png"]
    assert (out / "checkpoints" / "checkpoint-6" / "random_states_1.pkl").is_file()  # both processes' RNGs
    writers = {f.name.split(".")[-2] for f in (out / "logs").rglob("events.out.tfevents.*")}  # the writing pids
    assert len(writers) == 2  # one per run: rank 0 only
    assert "per device x 2" in second.stdout


def test_when_the_main_process_fails_to_write_a_grid_the_others_stop_too(tmp_path):
    out = tmp_path / "run"
    (out / "samples" / "0000.png").mkdir(parents=True)  # a folder where the first grid goes: rank 0 cannot write it
    # Two processes started by hand, as torch.distributed's environment variables describe
    # them: no launcher to kill the second when the first fails, so it must stop by itself.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        command = [sys.executable, "train.py", "--cpu", *flags(out, "--save_images_epochs", 1)]
        ranks.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    (_, err0), (_, err1) = (p.communicate(timeout=300) for p in ranks)
    assert [p.returncode for p in ranks] == [1, 1]
    last = err0.strip().splitlines()[-1]
    assert last.startswith("train.py: error: could not write") and "0000.png (Is a directory): make it writable" in last
    # rank 1 was told, and stopped without a word: not dead in a barrier when rank 0 went away
    assert "Traceback" not in err1 and "error" not in err1


def test_a_pipeline_that_could_not_be_saved_is_saved_by_running_again(tmp_path, monkeypatch, capsys, straight):
    from diffusers import DDPMPipeline

    real = DDPMPipeline.save_pretrained

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DDPMPipeline, "save_pretrained", disk_full)
    out = tmp_path / "run"
    assert exit_code(out) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "could not write the pipeline" in last and "the disk is full" in last and "free space" in last
    assert "run the same command again" in last and "Traceback" not in err
    assert checkpoints(out)[-1] == "checkpoint-6" and not (out / "model_index.json").exists()

    monkeypatch.setattr(DDPMPipeline, "save_pretrained", real)
    run(out)  # the same command: the pipeline from the last checkpoint, no more training
    assert "saved the pipeline to" in capsys.readouterr().out
    assert_same_weights(out, straight)
