"""EDM2 training through train.py's main: grids, checkpoints, the network, sample.py, ema.py, resume."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ddpm_train import config
from ddpm_train.training import ema as posthoc_ema
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
import sample
import train
from conftest import ROOT
from test_train import scalars

EDM = [
    "--model", "edm2tiny", "--image_size", "16", "--shapes_num_images", "32", "--train_batch_size", "4",
    "--num_inference_steps", "3", "--eval_batch_size", "4", "--lr_warmup_steps", "2", "--dataloader_num_workers", "0",
    "--max_train_steps", "8", "--checkpointing_steps", "4", "--save_images_epochs", "100",
    "--ema", "power", "--ema_snapshot_every", "4",
]  # fmt: skip


def run(output_dir, *flags):
    args = train.parse_args([*EDM, "--output_dir", str(output_dir), *map(str, flags)])
    args.timing_warmup_steps = 1  # a config.SETTINGS (train.py: 5): runs this short leave only their first step out
    return train.main(args)


@pytest.mark.slow
def test_an_edm2_run_writes_grids_checkpoints_and_a_network_that_sample_py_and_ema_py_load(tmp_path, capsys):
    out = tmp_path / "run"
    config = run(out)
    assert config["objective"] == "edm" and config["lr_scheduler"] == "inverse_sqrt" and config["num_inference_steps"] == 3
    # the loss's two terms (the weighted error and u(sigma)): printed beside it, logged, and in run.json
    final = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("final: "))
    terms = json.loads((out / "run.json").read_text())["final_loss_terms"]
    assert list(terms) == ["edm", "edm_logvar"] and f"(edm {terms['edm']:.4f}, edm_logvar {terms['edm_logvar']:.4f})" in final
    assert math.isclose(sum(terms.values()), json.loads((out / "run.json").read_text())["final_loss"], rel_tol=1e-5, abs_tol=1e-6)
    assert {"loss/edm", "loss/edm_logvar"} <= set(scalars(out))
    assert (out / "samples" / "0000.png").is_file()  # the last epoch always samples
    saved = json.loads((out / "unet" / "config.json").read_text())
    assert saved["_class_name"] == "EDM2UNet" and saved["pixel_norm"] is True  # Config G
    # u(sigma) trains with the network and is checkpointed, but is not part of the network
    objective_state = [torch.load(p, weights_only=False) for p in (out / "checkpoints" / "checkpoint-8").glob("custom_checkpoint_*.pkl")]
    assert any("logvar_linear.weight" in s for s in objective_state if isinstance(s, dict))
    assert not any("logvar" in k for k in load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors")))

    result = sample.main(sample.parse_args([str(out), "--num_images", "2", "--output", str(tmp_path / "gen")]))
    assert result["sampler"] == samplers.EDMHeunSampler(churn=samplers.EDM_CHURN).name
    assert result["num_inference_steps"] == objectives.EDMObjective.default_steps
    assert (tmp_path / "gen" / "grid.png").is_file()
    # EDM's stochastic sampler: other images than the ODE's from the same noise, each image its own noise
    def churned(churn, batch_size, folder):
        return sample.main(sample.parse_args([str(out), "--num_images", "2", "--num_inference_steps", "3", "--churn",
                                              str(churn), "--batch_size", str(batch_size), "--output", str(tmp_path / folder)]))  # fmt: skip

    assert churned(0, 2, "ode")["sampler"] == "edm_heun" and churned(5, 2, "sde")["sampler"] == "edm_heun_churn5"
    churned(5, 1, "sde_alone")
    png = lambda folder: (tmp_path / folder / "000001.png").read_bytes()  # noqa: E731
    assert png("sde") != png("ode") and png("sde") == png("sde_alone")

    rebuilt = posthoc_ema.main(posthoc_ema.parse_args(["reconstruct", str(out), "--std", "0.08"]))
    network = models.load_network(rebuilt / "unet")
    trained = models.load_network(out / "unet")
    assert all(torch.equal(a, b) for a, b in zip(network.buffers(), trained.buffers()))  # the run's Fourier features
    assert not all(torch.equal(a, b) for a, b in zip(network.parameters(), trained.parameters()))  # another EMA
    assert sample.main(sample.parse_args([str(rebuilt), "--num_images", "1", "--num_inference_steps", "2",
                                          "--output", str(tmp_path / "gen2")]))["sampler"].startswith("edm_heun")  # fmt: skip


def test_an_edm_run_resumes_bit_identically(tmp_path, capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, "--ema", "standard")
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-4", resumed / "checkpoints" / "checkpoint-4")
    run(resumed, "--ema", "standard")  # --resume (the default): from the newest checkpoint, checkpoint-4
    assert "checkpoint-4 at step 4" in capsys.readouterr().out  # "resumed from .../checkpoint-4 at step 4"
    for name in ("model.safetensors",):
        a = load_file(str(straight / "checkpoints" / "checkpoint-8" / name))
        b = load_file(str(resumed / "checkpoints" / "checkpoint-8" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    pickles = sorted(p.name for p in (straight / "checkpoints" / "checkpoint-8").glob("custom_checkpoint_*.pkl"))
    for name in pickles:  # the LR schedule, the EMA and the objective's u(sigma)
        a = torch.load(straight / "checkpoints" / "checkpoint-8" / name, weights_only=False)
        b = torch.load(resumed / "checkpoints" / "checkpoint-8" / name, weights_only=False)
        assert same(a, b), name


def same(a, b):
    """Equal, tensors bit for bit, through dicts and lists."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_inverse_sqrt_schedule_is_edm2s():
    args = config.resolve(config.parse_args(["--model", "edm2tiny", "--image_size", "16", "--lr_warmup_steps", "10",
                                            "--lr_ref_steps", "100"]))  # fmt: skip
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    schedule = models.make_lr_scheduler(args.lr_scheduler, optimizer, args.lr_warmup_steps, 10_000, args.lr_ref_steps)
    lrs = []
    for _ in range(400):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert lrs[5] == 0.5 and lrs[10] == lrs[100] == 1.0  # linear warm-up, then flat until t_ref
    assert math.isclose(lrs[400 - 1], 1 / math.sqrt(399 / 100)) and math.isclose(lrs[200], 1 / math.sqrt(2))


def test_an_edm2_network_refuses_the_ddpm_objective(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(train.parse_args(["--model", "edm2g", "--objective", "ddpm"]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained with --objective edm" in err[0]


# train.py with each rank's u(sigma) saved as built (after build_pieces) and at the end of main.
SAVE_U = """
import os, sys
sys.path.insert(0, {root!r})
import torch, train
rank, out, built = os.environ["RANK"], sys.argv[sys.argv.index("--output_dir") + 1], []
build_pieces = train.build_pieces
def saving(*a, **k):
    built.append(build_pieces(*a, **k))
    torch.save(built[0].objective.state_dict(), f"{{out}}-built{{rank}}.pt")
    return built[0]
train.build_pieces = saving
train.main(train.parse_args(sys.argv[1:]))
torch.save(built[0].objective.state_dict(), f"{{out}}-end{{rank}}.pt")
"""


@pytest.mark.slow
def test_a_two_process_edm_run_learns_one_weighting_and_resumes_bit_identically(tmp_path):
    """Each process draws its noise from its own seed, EDM's u(sigma) included when it is built; every process
    must train rank 0's u, so that a resume (which loads rank 0's) continues the straight run."""
    from test_faults import Ranks, start_two_ranks

    script = SAVE_U.format(root=str(ROOT))
    common = [*EDM, "--checkpointing_steps", "3", "--ema", "standard"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):  # the resumed run from the straight one's checkpoint-3
        if out == resumed:
            shutil.copytree(straight / "checkpoints" / "checkpoint-3", resumed / "checkpoints" / "checkpoint-3")
        ranks = Ranks(start_two_ranks([*common, "--output_dir", out, "--max_train_steps", 6], script))
        assert ranks.codes == [0, 0], ranks
        for moment in ("built", "end"):
            u0, u1 = (torch.load(f"{out}-{moment}{rank}.pt") for rank in (0, 1))
            assert same(u0, u1), f"{out.name} {moment}: the processes' u(sigma) differ"
    a, b = (load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors")) for out in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert same(*(torch.load(f"{out}-end0.pt") for out in (straight, resumed)))
