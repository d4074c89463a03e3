import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ddpm_train.training import ema
from ddpm_train.diffusion import loss_terms
from ddpm_train.networks import model as models
import train
from test_edm_train import same
from test_train import tensors_of

STDS = [0.05, 0.10]


def test_gamma_and_std_convert_both_ways_and_std_is_the_profile_width():
    for std in (0.01, 0.05, 0.10, 0.2):
        gamma = ema.std_to_gamma(std)
        assert ema.gamma_to_std(gamma) == pytest.approx(std, rel=1e-9)
        # the standard deviation of tau/t under the profile (gamma + 1) x^gamma, numerically
        x = np.linspace(0, 1, 200_001)
        p = (gamma + 1) * x**gamma
        mean = np.trapezoid(x * p, x)
        assert np.sqrt(np.trapezoid((x - mean) ** 2 * p, x)) == pytest.approx(std, rel=1e-4)
    assert ema.std_to_gamma(0.05) > ema.std_to_gamma(0.10)  # narrower profile, larger exponent


def test_profile_inner_product_matches_numerical_integration():
    tau = np.linspace(0, 1000, 400_001)

    def profile(t, gamma):
        return np.where(tau <= t, (gamma + 1) * tau**gamma / t ** (gamma + 1), 0.0)

    for (t_a, std_a), (t_b, std_b) in [((600, 0.05), (1000, 0.10)), ((1000, 0.05), (400, 0.2)), ((800, 0.1), (800, 0.1))]:
        g_a, g_b = ema.std_to_gamma(std_a), ema.std_to_gamma(std_b)
        numeric = np.trapezoid(profile(t_a, g_a) * profile(t_b, g_b), tau)
        assert ema.profile_inner_product(t_a, g_a, t_b, g_b) == pytest.approx(numeric, rel=1e-3)


@pytest.fixture(scope="module")
def tracked():
    """Power EMAs of a simulated trajectory, with snapshots every 100 of 2000 steps.

    Parameter 0 drifts linearly (theta = t), whose power EMA has the closed
    form (gamma + 1)/(gamma + 2) t; parameter 1 oscillates.
    """
    steps, every = 2000, 100
    theta = [torch.zeros(2)]
    tracker = ema.PowerEMA(theta, STDS)
    snapshots = {}
    for t in range(1, steps + 1):
        theta[0] = torch.tensor([float(t), np.sin(t / 150)])
        tracker.step(theta)
        if t % every == 0:
            for std, shadow in zip(STDS, tracker.shadows):
                snapshots[(t, std)] = shadow[0].double().clone()
    return steps, snapshots, {std: shadow[0].double() for std, shadow in zip(STDS, tracker.shadows)}


def reconstruct(snapshots, step, std, only_std=None):
    keys = sorted(k for k in snapshots if only_std is None or k[1] == only_std)
    weights = ema.reconstruction_weights([t for t, _ in keys], [s for _, s in keys], step, std)
    assert weights.sum() == pytest.approx(1)
    return sum(w * snapshots[k] for w, k in zip(weights, keys))


def test_tracked_power_ema_has_the_profile_of_its_std(tracked):
    steps, _, final = tracked
    for std in STDS:
        gamma = ema.std_to_gamma(std)
        # the discrete average of theta = 1..t sits half a step above the continuous one
        assert final[std][0].item() == pytest.approx((gamma + 1) / (gamma + 2) * steps, abs=1.0)


def test_reconstruction_for_a_tracked_std_matches_that_ema(tracked):
    steps, snapshots, final = tracked
    gap = (final[0.05] - final[0.10]).abs()
    for std in STDS:
        assert torch.allclose(reconstruct(snapshots, steps, std), final[std], rtol=1e-6, atol=1e-6)
    # and from the other std's snapshots alone: close, relative to how far the two EMAs are apart
    assert ((reconstruct(snapshots, steps, 0.05, only_std=0.10) - final[0.05]).abs() < 0.15 * gap).all()
    assert ((reconstruct(snapshots, steps, 0.10, only_std=0.05) - final[0.10]).abs() < 0.15 * gap).all()


def test_reconstruction_for_a_std_in_between_lies_between(tracked):
    steps, snapshots, final = tracked
    middle = reconstruct(snapshots, steps, 0.075)
    low, high = torch.minimum(final[0.05], final[0.10]), torch.maximum(final[0.05], final[0.10])
    assert ((low < middle) & (middle < high)).all(), (low, middle, high)
    gamma = ema.std_to_gamma(0.075)
    assert middle[0].item() == pytest.approx((gamma + 1) / (gamma + 2) * steps, abs=1.0)


# --- in a training run ---------------------------------------------------------------

TINY = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "32", "--train_batch_size", "8",
    "--num_inference_steps", "2", "--eval_batch_size", "4", "--lr_warmup_steps", "1", "--dataloader_num_workers", "0",
    "--save_images_epochs", "100", "--logging_steps", "4", "--learning_rate", "1e-3",
    "--ema", "power", "--ema_stds", "0.05,0.10", "--ema_snapshot_every", "3", "--max_train_steps", "8",
    "--checkpointing_steps", "4",
]  # fmt: skip


def run(output_dir, *flags):
    args = train.parse_args([*TINY, "--output_dir", str(output_dir), *map(str, flags)])
    args.timing_warmup_steps = 1  # a config.SETTINGS (train.py: 5): runs this short leave only their first step out
    return train.main(args)


@pytest.fixture(scope="module")
def power_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("power")
    run(out)
    return out


def test_power_ema_run_writes_snapshots_and_its_first_std_is_the_pipeline(power_run):
    snapshots = ema.list_snapshots(power_run / ema.SNAPSHOT_DIR)
    assert [(step, std) for step, std, _ in snapshots] == [(s, std) for s in (3, 6, 8) for std in STDS]  # 8: the end
    final = load_file(str(power_run / "unet" / "diffusion_pytorch_model.safetensors"))
    first = load_file(str(snapshots[-2][2]))  # step 8, std 0.05
    assert first.keys() == final.keys() and all(torch.equal(first[k], final[k]) for k in final)
    other = load_file(str(snapshots[-1][2]))  # step 8, std 0.10
    assert any(not torch.equal(other[k], final[k]) for k in final)


def test_reconstruct_command_saves_a_pipeline_that_samples(power_run, tmp_path, capsys):
    from diffusers import DDPMPipeline

    import sample

    out = ema.main(ema.parse_args(["reconstruct", str(power_run), "--std", "0.05"]))
    assert out == power_run / "ema-std-0.05"
    final = load_file(str(power_run / "unet" / "diffusion_pytorch_model.safetensors"))
    rebuilt = load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.allclose(rebuilt[k], final[k], rtol=1e-5, atol=1e-6) for k in final)

    out = ema.main(ema.parse_args(["reconstruct", str(power_run), "--std", "0.07", "--output", str(tmp_path / "p07")]))
    used = json.loads((out / "ema.json").read_text())
    assert used["step"] == 8 and len(used["snapshots"]) == 6
    assert "reconstructed the EMA with sigma_rel 0.07 at step 8 from 6 snapshots" in capsys.readouterr().out
    DDPMPipeline.from_pretrained(str(out))
    sample.main(sample.parse_args([str(out), "--num_images", "2", "--num_inference_steps", "2", "--output", str(tmp_path / "images")]))
    assert len(list((tmp_path / "images").glob("0*.png"))) == 2


def test_power_ema_resumes_bit_identically(power_run, tmp_path, capsys):
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(power_run / "checkpoints" / "checkpoint-4", resumed / "checkpoints" / "checkpoint-4")
    run(resumed)  # --resume (the default): from the newest checkpoint
    assert "checkpoint-4 at step 4" in capsys.readouterr().out  # "resumed from .../checkpoint-4 at step 4"
    after = sorted(p.name for p in (resumed / ema.SNAPSHOT_DIR).glob("*.safetensors"))  # the snapshots since step 4
    straight = sorted(p.name for p in (power_run / ema.SNAPSHOT_DIR).glob("*.safetensors") if int(p.name.split("-")[1]) > 4)
    assert after == straight and len(after) == 4, after  # steps 6 and 8, each std
    for name in after:
        a, b = load_file(str(power_run / ema.SNAPSHOT_DIR / name)), load_file(str(resumed / ema.SNAPSHOT_DIR / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    for part in ("checkpoints/checkpoint-8", "unet"):  # the weights, the EMAs' state and the saved network
        (a, _), (b, _) = tensors_of(power_run / part), tensors_of(resumed / part)
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), part
    pickles = sorted(p.name for p in (power_run / "checkpoints" / "checkpoint-8").glob("custom_checkpoint_*.pkl"))
    assert pickles and all(same(*(torch.load(r / "checkpoints" / "checkpoint-8" / name, weights_only=False)
                                  for r in (power_run, resumed))) for name in pickles)  # fmt: skip


BAD = [
    (["--ema_stds", "0.05,0.5"], "--ema_stds '0.05,0.5': each must be between 0 and 0.2887"),
    (["--ema_stds", "wide"], "give comma-separated numbers"),
    # turning the EMA off is --ema none now (one flag: no conflicting pair); the old switch says so
    (["--no-use_ema"], "--no-use_ema was removed: use --ema none, standard or power"),
    (["--ema_snapshot_every", "0"], "--ema_snapshot_every must be at least 1"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[m for _, m in BAD])
def test_bad_power_ema_flags_are_one_line_and_exit_code_2(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, *flags)
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize(
    "flags, message",
    [(["--std", "0.3"], "--std must be between 0 and 0.2887"), (["--std", "0.07"], "no EMA snapshots"),
     (["--std", "0.07", "--step", "5"], "no EMA snapshots")],
)  # fmt: skip
def test_bad_reconstruct_input_is_one_line_and_exit_code_2(tmp_path, capsys, flags, message):
    (tmp_path / "train_config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        ema.main(ema.parse_args(["reconstruct", str(tmp_path), *flags]))
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], err


def test_reconstruct_at_a_step_without_snapshot_names_the_steps(power_run, capsys):
    with pytest.raises(SystemExit):
        ema.main(ema.parse_args(["reconstruct", str(power_run), "--std", "0.07", "--step", "5"]))
    assert "--step 5: no snapshot at that step; there are 3, 6, 8" in capsys.readouterr().err


def test_the_standard_ema_is_diffusers_update_in_one_pass_over_the_weights():
    """--ema standard (ema.LerpEMA): diffusers' EMAModel's decay, warm-up and state, its foreach update one lerp
    over the weights and averages (diffusers' two subtractions also write and read a temporary copy of every
    weight); a weight that is not trained is copied, as diffusers copies it."""
    from diffusers.training_utils import EMAModel
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    network[1].bias.requires_grad_(False)
    settings = dict(decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75, foreach=True)
    ours, theirs = ema.LerpEMA(network.parameters(), **settings), EMAModel(network.parameters(), **settings)
    for _ in range(5):
        with torch.no_grad():
            for p in network.parameters():
                p.add_(torch.randn_like(p))
        with Ops() as ops:
            ours.step(network.parameters())
        theirs.step(network.parameters())
        assert ours.cur_decay_value == theirs.cur_decay_value and ours.optimization_step == theirs.optimization_step
        for a, b in zip(ours.shadow_params, theirs.shadow_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ops.names.count("_foreach_lerp_.Scalar") == 1 and not [n for n in ops.names if "sub" in n], ops.names
    assert torch.equal(ours.shadow_params[3], network[1].bias)  # not trained: copied
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    loop = ema.LerpEMA(network.parameters(), **dict(settings, foreach=False))  # the ladder's diffusers_example row
    with Ops() as ops:
        loop.step(network.parameters())
    assert "lerp" not in " ".join(ops.names) and ops.names.count("sub_.Tensor") == 3, ops.names  # diffusers' loop
    standard = SimpleNamespace(ema="standard", ema_max_decay=0.9999, ema_inv_gamma=1.0, ema_power=0.75)
    assert type(ema.make_ema(standard, network, write=False)) is ema.LerpEMA  # what train.py builds


def test_the_averaged_copy_writes_nothing_into_the_training_objectives_block_outputs():
    """--loss_terms dispersive hooks the network's middle block to keep its output in the objective's dict
    (loss_terms.attach, as builder.build calls it). The EMA's copy (averaged_copy: grids, the saved pipeline)
    must not carry that hook: its forward wrote into the live objective's dict and pinned an activation there.
    The network's own hook still keeps its output."""
    network = models.build_network("tiny", 16)
    objective = loss_terms.attach(SimpleNamespace(), network, models.family("tiny")[0], loss_terms.parse("dispersive"))
    outputs = objective.readers[0].blocks.outputs
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 500])
    with torch.no_grad():
        ema.averaged_copy(network, None)(x, t)
        assert outputs == {}  # the copy's call kept nothing
        network(x, t)
    assert list(outputs) == list(objective.readers[0].names)  # the training network's hook is still there
