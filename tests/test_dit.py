"""DiT presets (dit.py): the papers' parameter counts, one shared embedder, label dropout once per
image in the loop, diffusers loading, and every objective and path at a tiny size."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from ddpm_train.training import checkpoint
from ddpm_train.networks import dit
from ddpm_train.networks import model as models
import sample
from test_train import run as train
from test_train import tensors_of

DIT = ["--model", "dit-tiny", "--save_images_epochs", 100]


@pytest.mark.parametrize("size, expected", [("xl", 674_834_720), ("l", 457_840_672), ("b", 130_315_808), ("s", 32_865_056)])
def test_the_paper_sizes_have_their_trainable_parameter_counts(size, expected):
    """DiT's Table 1 configurations with ImageNet's 1000 classes, 4 latent channels in and 8 out (the learned
    variance): the paper's counts less its fixed position table. diffusers' per-block embedders would add
    27 x 2,777,472 to XL/2 (749,826,464)."""
    with torch.device("meta"):
        net = dit.build(size, 2, 32, in_channels=4, out_channels=8, num_classes=1000)
    assert dit.trainable_parameters(net) == expected
    assert net.pos_embed.pos_embed.numel() == 256 * dit.SIZES[size][1] and not net.pos_embed.pos_embed.requires_grad


def tiny_net(num_classes=3):
    torch.manual_seed(0)
    net = dit.DiT(num_classes=num_classes, num_layers=2, num_attention_heads=2, attention_head_dim=8, in_channels=3,
                  sample_size=8, patch_size=2)  # fmt: skip
    with torch.no_grad():
        for p in net.parameters():  # adaLN-Zero starts at zero: random weights make every path count
            p.normal_(0, 0.05)
    return net


def test_one_embedder_serves_every_block_and_drops_no_label():
    net = tiny_net().train()
    embedders = {id(block.norm1.emb) for block in net.transformer_blocks}
    assert len(embedders) == 1
    x, t, y = torch.randn(64, 3, 8, 8), torch.full((64,), 500.0), torch.zeros(64, dtype=torch.long)
    # in training mode diffusers' embedder would swap 10% of the labels for the null label at random
    assert torch.equal(net(x, t, y).sample, net(x, t, y).sample)


def test_a_saved_dit_loads_in_diffusers_and_here_with_the_same_outputs(tmp_path):
    from diffusers import DiTTransformer2DModel

    net = tiny_net().eval()
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([10.0, 900.0]), torch.tensor([0, 3])
    expected = net(x, t, y).sample
    net.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["_class_name"] == "DiTTransformer2DModel"
    theirs = DiTTransformer2DModel.from_pretrained(tmp_path).eval()
    assert torch.equal(theirs(x, t, y).sample, expected)
    ours = models.load_network(tmp_path)
    assert isinstance(ours, dit.DiT) and torch.equal(ours(x, t, y).sample, expected)
    assert ours.transformer_blocks[1].norm1.emb is ours.transformer_blocks[0].norm1.emb
    assert dit.trainable_parameters(ours) == dit.trainable_parameters(net)


def test_it_takes_a_unet_s_call_one_timestep_and_no_labels():
    net = tiny_net().eval()
    x = torch.randn(2, 3, 8, 8)
    batch = net(x, torch.full((2,), 500.0), torch.full((2,), 3)).sample  # 3: the null label of 3 classes
    assert torch.equal(net(x, torch.tensor(500.0)).sample, batch)
    unconditional = tiny_net(num_classes=0).eval()
    assert unconditional.config.num_embeds_ada_norm == 1
    assert torch.equal(unconditional(x, 500.0).sample, unconditional(x, 500.0, torch.zeros(2, dtype=torch.long)).sample)


@pytest.mark.parametrize("objective", ["ddpm", "flow:2", "edm"])
def test_each_objective_trains_a_dit_and_sample_py_samples_it(tmp_path, objective, capsys):
    out = tmp_path / "run"
    train(out, *DIT, "--objective", objective, "--max_train_steps", 3)
    assert isinstance(models.load_network(out / "unet"), dit.DiT) and not (out / "model_index.json").exists()
    assert f"saved the network to {out}; " in capsys.readouterr().out  # not "the pipeline": there is none
    result = sample.main(sample.parse_args([str(out), "--num_images", "2", "--num_inference_steps", "3",
                                            "--output", str(tmp_path / "s")]))  # fmt: skip
    image = np.asarray(Image.open(tmp_path / "s" / "000000.png"))
    assert result["num_images"] == 2 and image.shape == (16, 16, 3) and image.std() > 0
    card = (out / "README.md").read_text()  # no DDPMPipeline line: that pipeline cannot call a DiT
    assert "DiTTransformer2DModel.from_pretrained" in card and "DDPMPipeline" not in card


@pytest.mark.slow
def test_a_class_conditional_latent_dit_guides_and_samples_by_class(tmp_path, monkeypatch, default_shape_scorer):
    """Flow (SiT's recipe) on a VAE's latents with class labels: guidance, autoguidance, FID in training, the
    power EMA's snapshots, sample.py by class name."""
    from ddpm_train.data import latents
    from test_latents import make_kl

    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "latent-cache"))
    out = tmp_path / "run"
    train(out, *DIT, "--vae", make_kl(tmp_path / "kl"), "--objective", "flow", "--class_conditional",
          "--max_train_steps", 4, "--checkpointing_steps", 2, "--shapes_num_images", 16, "--train_batch_size", 4,
          "--ema", "power", "--ema_snapshot_every", 2, "--eval_every_epochs", 1, "--eval_num_samples", 4,
          "--guidance_scale", "3,1")  # fmt: skip
    net = models.load_network(out / "unet")
    assert net.config.num_classes == 3 and net.config.in_channels == 4
    (result,) = json.loads((out / "eval_results.json").read_text())  # FID/KID of decoded samples, at each scale
    assert [s["guidance_scale"] for s in result["scales"]] == [3.0, 1.0] and np.isfinite(result["fid"])
    snapshots = sorted(p.name for p in (out / "ema_snapshots").glob("*.safetensors"))  # the power EMA's
    assert [int(name.split("-")[1]) for name in snapshots] == [2, 2, 4, 4], snapshots  # each std at steps 2 and 4

    def by_class(labels, folder, *flags):
        sample.main(sample.parse_args([str(out), "--num_images", "1", "--class_labels", labels, "--output",
                                       str(tmp_path / folder), "--num_inference_steps", "3", *flags]))  # fmt: skip
        return np.asarray(Image.open(tmp_path / folder / "000000.png"))

    circle = by_class("circle", "c", "--guidance_scale", "3")
    assert not np.array_equal(circle, by_class("square", "s", "--guidance_scale", "3"))
    unguided = by_class("circle", "c1", "--guidance_scale", "1")
    assert not np.array_equal(circle, unguided)  # the guidance acts
    # autoguidance: by the run's earlier checkpoint it changes the images; by the run itself it is the run alone
    early = str(out / "checkpoints" / "checkpoint-2")
    assert not np.array_equal(by_class("circle", "a", "--guide", early, "--guidance_scale", "2"), unguided)
    assert np.array_equal(by_class("circle", "a1", "--guide", str(out), "--guidance_scale", "2"), unguided)
    # ema.py reconstructs another EMA from the snapshots, whose parameters name the shared embedder once
    from ddpm_train.training import ema as posthoc_ema

    folder = posthoc_ema.main(posthoc_ema.parse_args(["reconstruct", str(out), "--std", "0.05"]))
    rebuilt = models.load_network(folder / "unet")
    assert rebuilt.transformer_blocks[1].norm1.emb is rebuilt.transformer_blocks[0].norm1.emb
    snapshot = load_file(str(out / "ema_snapshots" / snapshots[-2]))  # step 4, std 0.05: the reconstruction at 4
    assert all(torch.allclose(p, snapshot[name], atol=1e-6) for name, p in rebuilt.named_parameters())
    # moved out of the run, it still samples: the run's train_config.json went with it (a network saved
    # without a pipeline has its objective, schedule and VAE there); without that file, one line says so
    moved = tmp_path / "elsewhere"
    shutil.copytree(folder, moved)
    sample.main(sample.parse_args([str(moved), "--num_images", "1", "--num_inference_steps", "2", "--class_labels",
                                   "circle", "--output", str(tmp_path / "m")]))  # fmt: skip
    assert (tmp_path / "m" / "000000.png").is_file()
    (moved / "train_config.json").unlink()
    with pytest.raises(SystemExit) as exit_info:
        sample.main(sample.parse_args([str(moved), "--num_images", "1", "--output", str(tmp_path / "m2")]))
    assert exit_info.value.code == 2


@pytest.mark.parametrize("routing", ["0", "0.5"])
def test_a_dit_run_resumes_bit_identically(tmp_path, capsys, monkeypatch, routing):
    """The shared embedder's tensors are one in the checkpoint (the state dict holds them once) and one
    module again after loading; with --token_routing, the tokens routed are drawn again the same."""
    from accelerate import Accelerator

    flags = [*DIT, "--max_train_steps", 4, "--checkpointing_steps", 2, "--train_batch_size", 4, "--class_conditional",
             "--token_routing", routing]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *flags)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2")
    capsys.readouterr()
    tied_after_loading = []
    load_state = Accelerator.load_state

    def loading(accelerator, *args, **kwargs):
        result = load_state(accelerator, *args, **kwargs)
        blocks = accelerator.unwrap_model(accelerator._models[0]).transformer_blocks
        tied_after_loading.append(all(block.norm1.emb is blocks[0].norm1.emb for block in blocks))
        return result

    monkeypatch.setattr(Accelerator, "load_state", loading)
    train(resumed, *flags)
    assert f"resumed from {resumed / 'checkpoints' / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert tied_after_loading == [True]
    for part in ("checkpoints/checkpoint-4", "unet"):
        a, _ = tensors_of(straight / part)
        b, _ = tensors_of(resumed / part)
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[key], b[key]) for key in a), part
    stored = {k.split(".norm1.emb.")[0] for k in tensors_of(resumed / "checkpoints/checkpoint-4")[0] if ".norm1.emb." in k}
    assert stored == {"model.safetensors:transformer_blocks.0"}, stored  # one copy, not one per block
    saved = models.load_network(resumed / "unet")
    assert saved.transformer_blocks[1].norm1.emb is saved.transformer_blocks[0].norm1.emb


def test_a_dit_checkpoint_is_saved_without_accelerate_s_shared_tensor_warning(tmp_path, caplog):
    """accelerate's safetensors save removes tensors that share memory and warns that it did; a DiT's state
    dict holds its tied embedder once, so checkpoint.save (accelerate's save_state) removes and says nothing.
    It loads back tied, with the saved weights."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = accelerator.prepare(tiny_net())
    saved = {name: p.clone() for name, p in net.named_parameters()}
    with caplog.at_level(logging.WARNING):
        folder = checkpoint.save(accelerator, tmp_path, 1, {}).wait()
    assert not [r.getMessage() for r in caplog.records if "Removed shared tensor" in r.getMessage()]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    accelerator.load_state(str(folder))
    blocks = net.transformer_blocks
    assert all(block.norm1.emb is blocks[0].norm1.emb for block in blocks)
    assert all(torch.equal(p, saved[name]) for name, p in net.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("routing, optimizer", [("0", "adamw"), ("0.5", "adamw"), ("0", "muon")])
def test_two_processes_train_a_dit_as_one(tmp_path, routing, optimizer):
    """Each rank its own σ and images (and tokens routed), the same weights at every step (gradients averaged, and
    Muon's orthogonalized alike in each), rank 0 alone saving."""
    from test_flow import assert_trained_as_one, two_flow_ranks
    from test_train import TINY

    out = tmp_path / "run"
    ranks, events = two_flow_ranks(tmp_path, [*TINY, *DIT, "--objective", "flow", "--max_train_steps", 3,
                                              "--output_dir", out, "--logger", "none", "--token_routing", routing,
                                              "--optimizer", optimizer])  # fmt: skip
    assert ranks.codes == [0, 0], ranks
    assert_trained_as_one(events, steps=3)
    assert json.loads((out / "train_config.json").read_text())["num_processes"] == 2
    assert isinstance(models.load_network(out / "unet"), dit.DiT)


def test_a_dit_preset_refuses_an_image_size_its_patches_do_not_divide(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train(tmp_path / "out", "--model", "dit-tiny", "--image_size", "15")
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cuts its input into 2x2 patches" in line and "multiple of 2" in line


def test_diffusers_dit_pipeline_samples_a_saved_1000_class_latent_dit(tmp_path):
    """docs/dit.md's answer: DiTPipeline works for a 1000-class network on latents scaled by the VAE's
    scaling_factor with a DDPM scheduler (its null class is hard-coded as 1000, and it calls the scheduler's
    scale_model_input, which FlowMatchEulerDiscreteScheduler lacks: a flow run samples with sample.py)."""
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel
    from test_latents import make_kl

    torch.manual_seed(0)
    models.build_network("dit-tiny", 8, num_classes=1000, channels=4).save_pretrained(tmp_path / "unet")
    pipeline = DiTPipeline(transformer=DiTTransformer2DModel.from_pretrained(tmp_path / "unet"),
                           vae=AutoencoderKL.from_pretrained(make_kl(tmp_path / "kl")), scheduler=DDIMScheduler())  # fmt: skip
    images = pipeline(class_labels=[3, 999], guidance_scale=1.5, num_inference_steps=2, output_type="np").images
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()
