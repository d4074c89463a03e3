"""--init_from: a new run from trained weights, offline, on tiny sources the tests save in each layout (a DDPMPipeline
folder, a bare model folder, a DiT in diffusers' layout, a run of this project), read by the code a Hub id's download
goes through."""

import json

import pytest
import torch
from diffusers import DDIMScheduler, DDPMPipeline, DDPMScheduler, DiTTransformer2DModel, UNet2DModel

from ddpm_train import config
from ddpm_train.networks import init_from
from ddpm_train.networks import model as models
from ddpm_train.training import rundir
import train
from ddpm_train.training import builder
from test_train import run

# google/ddpm-cifar10-32's time embedding and padding, which diffusers' defaults (and so the presets) do not share
GOOGLE = dict(flip_sin_to_cos=False, freq_shift=1, downsample_padding=0, norm_eps=1e-6)


def tiny_unet(**extra):
    torch.manual_seed(1)
    return UNet2DModel(sample_size=16, **models.PRESETS["tiny"].settings, **GOOGLE, **extra)


@pytest.fixture
def pipeline(tmp_path):
    """A DDPMPipeline folder (as google/ddpm-cifar10-32 is) of a UNet with the `tiny` preset's layout."""
    folder = tmp_path / "pipeline"
    DDPMPipeline(unet=tiny_unet(), scheduler=DDPMScheduler(prediction_type="epsilon")).save_pretrained(str(folder))
    return folder


def tiny_dit(in_channels=3, classes=10):
    """A diffusers DiTTransformer2DModel in facebook/DiT-XL-2-256's layout at dit-tiny's size: learned variance
    (twice the input channels out), `classes` classes and the null one, every block's embedder equal (DiT's one)."""
    torch.manual_seed(2)
    net = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=in_channels,
                                out_channels=2 * in_channels, num_layers=2, sample_size=8, patch_size=2,
                                num_embeds_ada_norm=classes)  # fmt: skip
    for block in net.transformer_blocks[1:]:
        block.norm1.emb.load_state_dict(net.transformer_blocks[0].norm1.emb.state_dict())
    return net.eval()


@pytest.fixture
def dit_pipeline(tmp_path):
    folder = tmp_path / "dit"
    tiny_dit().save_pretrained(str(folder / "transformer"))
    DDIMScheduler(prediction_type="epsilon", clip_sample=False).save_pretrained(str(folder / "scheduler"))
    return folder


def resolved(*flags):
    return config.resolve(config.parse_args(list(map(str, flags))))


def equal_states(a, b, skip=()):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a if k not in skip)


def test_a_pipeline_source_gives_the_preset_its_settings_and_its_training(pipeline, tmp_path):
    args = resolved("--init_from", pipeline, "--output_dir", tmp_path / "out")
    assert (args.model, args.image_size, args.objective, args.prediction_type, args.beta_schedule) == (
        "tiny", 16, "ddpm", "epsilon", "linear")  # fmt: skip
    assert args.init_source["settings"] == GOOGLE  # the network is built as the source's, not the preset's defaults
    pieces = builder.build(args, 10)
    source = tiny_unet()
    assert equal_states(pieces.network.state_dict(), source.state_dict())
    assert not pieces.optimizer.state  # fresh
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 900])
    with torch.no_grad():
        assert torch.allclose(pieces.network(x, t).sample, source(x, t).sample, atol=1e-5)
    assert "initialized from" in pieces.started_from and "nothing adapted" in pieces.started_from


def test_the_scheduler_decides_the_objective_unless_the_command_line_does(tmp_path):
    folder = tmp_path / "v"
    DDPMPipeline(unet=tiny_unet(), scheduler=DDPMScheduler(prediction_type="v_prediction",
                                                           beta_schedule="squaredcos_cap_v2")).save_pretrained(str(folder))  # fmt: skip
    args = resolved("--init_from", folder)
    assert (args.objective, args.prediction_type, args.beta_schedule) == ("ddpm", "v_prediction", "squaredcos_cap_v2")
    args = resolved("--init_from", folder, "--prediction_type", "epsilon")
    assert (args.objective, args.prediction_type, args.beta_schedule) == ("ddpm", "epsilon", "squaredcos_cap_v2")
    args = resolved("--init_from", folder, "--objective", "flow")
    assert args.objective == "flow" and args.prediction_type is None  # none of DDPM's flags for a flow run


def test_a_schedule_this_project_does_not_train_is_refused(tmp_path):
    folder = tmp_path / "other"
    DDPMPipeline(unet=tiny_unet(), scheduler=DDPMScheduler(num_train_timesteps=500)).save_pretrained(str(folder))
    with pytest.raises(config.ConfigError, match="500 steps.*: add --objective"):
        resolved("--init_from", folder)
    args = resolved("--init_from", folder, "--objective", "flow")  # --objective says what to train: its weights start it
    assert args.objective == "flow" and args.init_source["trained"]["refused"]


def test_a_bare_model_folder_loads_and_needs_an_objective(tmp_path):
    folder = tmp_path / "bare"
    tiny_unet().save_pretrained(str(folder))
    with pytest.raises(config.ConfigError, match="no scheduler config beside it"):
        resolved("--init_from", folder)
    args = resolved("--init_from", folder, "--objective", "ddpm")
    assert args.model == "tiny" and args.prediction_type == "epsilon"  # the fallback, as said
    assert equal_states(builder.build(args, 10).network.state_dict(), tiny_unet().state_dict())


def test_a_pipelines_unet_folder_finds_the_scheduler_beside_it(pipeline):
    assert resolved("--init_from", pipeline / "unet").objective == "ddpm"


def fails(capsys, *flags, output_dir):
    """train.py's exit code and stderr for `flags`; nothing may be written in `output_dir`."""
    with pytest.raises(SystemExit) as exit_:
        run(output_dir, *flags)
    err = capsys.readouterr().err
    assert not output_dir.exists()
    return exit_.value.code, err


def test_a_model_that_disagrees_is_refused_in_one_line(pipeline, tmp_path, capsys):
    code, err = fails(capsys, "--init_from", pipeline, "--model", "small", output_dir=tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "--model small disagrees with --init_from" in err


def test_a_source_of_other_channels_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "latent-dit"
    tiny_dit(in_channels=4).save_pretrained(str(folder / "transformer"))
    DDPMScheduler().save_pretrained(str(folder / "scheduler"))
    code, err = fails(capsys, "--init_from", folder, "--model", "auto", output_dir=tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "takes 4-channel inputs" in err


def test_an_unknown_architecture_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "cond"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel", "in_channels": 4}))
    code, err = fails(capsys, "--init_from", folder, output_dir=tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "UNet2DConditionModel, not one this project trains" in err


def test_a_layout_no_preset_has_is_refused(tmp_path):
    folder = tmp_path / "wide"
    UNet2DModel(sample_size=16, block_out_channels=(16, 48), down_block_types=("DownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8, layers_per_block=1).save_pretrained(str(folder))  # fmt: skip
    with pytest.raises(config.ConfigError, match="no preset has its network's layout"):
        resolved("--init_from", folder, "--objective", "ddpm")


def test_a_hub_id_is_downloaded_then_read_as_a_folder(pipeline, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: asked.append(repo) or str(pipeline))
    args = resolved("--init_from", "google/ddpm-tiny-16")
    assert asked == ["google/ddpm-tiny-16"] and args.model == "tiny" and args.init_source["source"] == "google/ddpm-tiny-16"

    def offline(repo, **kw):
        raise LocalEntryNotFoundError("offline, and not in the local cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(config.ConfigError, match="hf download google/ddpm-tiny-16 --local-dir DIR"):
        resolved("--init_from", "google/ddpm-tiny-16")


def test_a_dit_in_diffusers_layout_loads_with_its_variance_and_labels_adapted(dit_pipeline):
    args = resolved("--init_from", dit_pipeline)
    assert (args.model, args.image_size, args.objective) == ("dit-tiny", 8, "ddpm")
    pieces = builder.build(args, 10)  # unconditional: its one label is the source's null label
    source, net = tiny_dit(), pieces.network
    cut = {"proj_out_2.weight", "proj_out_2.bias", "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight"}
    theirs = {k: v for k, v in source.state_dict().items() if not k.startswith("transformer_blocks.1.norm1.emb.")}
    assert equal_states(net.state_dict(), theirs, skip=cut)
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([10, 900])
    with torch.no_grad():
        want = source(x, t, class_labels=torch.tensor([10, 10])).sample[:, :3]  # the null label's noise prediction
        assert torch.allclose(net(x, t).sample, want, atol=1e-5)
    assert "learned-variance output (6 channels) cut to the first 3" in pieces.started_from
    # another size: the fixed sin-cos position embeddings are recomputed for its patches
    args = resolved("--init_from", dit_pipeline, "--image_size", 16)
    pieces = builder.build(args, 10)
    assert pieces.network(torch.randn(1, 3, 16, 16), 5).sample.shape == (1, 3, 16, 16)
    assert "inputs of 16x16 (its position embeddings recomputed for 8x8 patches), not its 8x8" in pieces.started_from


def test_untied_embedders_are_tied_to_block_0s_and_said(tmp_path):
    folder = tmp_path / "untied"
    net = tiny_dit()
    torch.nn.init.normal_(net.transformer_blocks[1].norm1.emb.timestep_embedder.linear_1.weight)
    net.save_pretrained(str(folder / "transformer"))
    DDPMScheduler().save_pretrained(str(folder / "scheduler"))
    pieces = builder.build(resolved("--init_from", folder), 10)
    assert "tied to block 0's" in pieces.started_from
    assert torch.equal(pieces.network.transformer_blocks[1].norm1.emb.timestep_embedder.linear_1.weight,
                       net.transformer_blocks[0].norm1.emb.timestep_embedder.linear_1.weight)  # fmt: skip


def test_a_conditional_fine_tune_of_an_unconditional_unet_starts_as_the_source(pipeline):
    args = resolved("--init_from", pipeline, "--class_conditional")
    pieces = builder.build(args, 10, num_classes=3)
    table = pieces.network.class_embedding.weight
    assert table.shape == (4, pieces.network.time_embedding.linear_2.out_features) and not table.any()
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 900])
    with torch.no_grad():
        assert torch.allclose(pieces.network(x, t, class_labels=torch.tensor([0, 2])).sample, tiny_unet()(x, t).sample,
                              atol=1e-5)  # fmt: skip
    assert "a new label table for this run's 3 classes" in pieces.started_from


@pytest.mark.slow
def test_a_fine_tune_starts_at_step_0_records_its_source_and_a_resume_continues_it(pipeline, tmp_path, capsys):
    out = tmp_path / "out"
    flags = ["--model", "auto", "--init_from", pipeline, "--checkpointing_steps", 2, "--ema", "none"]
    run(out, *flags, "--max_train_steps", 2)
    said = capsys.readouterr().out
    assert "initialized from" in said and "resumed" not in said
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["init_from"] == str(pipeline) and recorded["init_source"]["path"] == str(pipeline / "unet")
    assert recorded["init_source"]["weights_sha256"] == init_from.state_sha256(tiny_unet().state_dict())
    assert json.loads((out / "run.json").read_text())["config"]["init_source"]["weights_sha256"] == recorded["init_source"]["weights_sha256"]
    assert json.loads((out / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text())["step"] == 2
    trained = rundir.load_model(out / "checkpoints" / "checkpoint-2", ema=False)[0]
    assert trained.config.flip_sin_to_cos is False  # a checkpoint reads back with the source's settings
    assert not equal_states(trained.state_dict(), tiny_unet().state_dict())  # it trained
    # preempted: the same command continues from its checkpoint, not from the source
    run(out, *flags, "--max_train_steps", 4)
    said = capsys.readouterr().out
    assert "resumed from" in said and "at step 2" in said and "initialized from" not in said
    assert json.loads((out / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())["step"] == 4
    # its record read back with --config resolves again (the source's record is derived, not a flag)
    assert config.resolve(config.parse_args(["--config", str(out / "train_config.json")])).init_source["model"] == "tiny"


def test_a_run_of_this_project_is_a_source_at_step_0(tmp_path, capsys):
    source, out = tmp_path / "source", tmp_path / "out"
    run(source, "--max_train_steps", 3, "--objective", "ddpm", "--prediction_type", "v_prediction")
    capsys.readouterr()
    args = resolved("--init_from", source, "--output_dir", out)
    assert (args.model, args.objective, args.prediction_type) == ("tiny", "ddpm", "v_prediction")
    network, _ = rundir.load_model(source)  # its EMA, as sample.py samples it
    assert equal_states(builder.build(args, 10).network.state_dict(), network.state_dict())
    run(out, "--init_from", source, "--max_train_steps", 2)
    assert "initialized from" in capsys.readouterr().out
    assert json.loads((out / "run.json").read_text())["steps"] == 2  # from 0, not the source's step 3
    assert train.resume.differences({"init_from": str(source)}, {"init_from": None})  # a resume keeps its source


def test_what_is_no_source_is_refused_in_one_line_each(pipeline, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    for source, says in [(tmp_path / "file", "is a file"), (tmp_path / "missing", "no such folder; check the path"),
                         (tmp_path / "empty", "holds no diffusers pipeline")]:  # fmt: skip
        with pytest.raises(config.ConfigError, match=says):
            resolved("--init_from", source)
    (pipeline / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"not weights")
    with pytest.raises(config.ConfigError, match="cannot load the UNet2DModel"):
        resolved("--init_from", pipeline)


def test_outputs_and_class_embeddings_this_project_cannot_train_are_refused(tmp_path):
    for name, net, says in [("out6", tiny_unet(out_channels=6), "outputs 6 channels for 3 in"),
                            ("timestep", tiny_unet(class_embed_type="timestep"), "is not a label table")]:  # fmt: skip
        net.save_pretrained(str(tmp_path / name))
        with pytest.raises(config.ConfigError, match=says):
            resolved("--init_from", tmp_path / name, "--objective", "ddpm")


def test_weights_that_do_not_fit_the_network_are_refused_in_one_line(pipeline):
    record = resolved("--init_from", pipeline).init_source
    with pytest.raises(config.ConfigError, match="its weights do not fit --model tiny"):
        init_from.initial_state(record, models.build_network("small", 16), 0)


# The Hub configs, as their config.json files give them (the keys that decide the preset and the settings).
GOOGLE_CIFAR10 = dict(_class_name="UNet2DModel", block_out_channels=[128, 256, 256, 256], layers_per_block=2,
                      down_block_types=["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
                      up_block_types=["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"], attention_head_dim=None,
                      sample_size=32, in_channels=3, out_channels=3, **GOOGLE)  # fmt: skip
GOOGLE_256 = dict(GOOGLE_CIFAR10, block_out_channels=[128, 128, 256, 256, 512, 512], sample_size=256,
                  down_block_types=["DownBlock2D"] * 4 + ["AttnDownBlock2D", "DownBlock2D"],
                  up_block_types=["UpBlock2D", "AttnUpBlock2D"] + ["UpBlock2D"] * 4)  # fmt: skip
DIT_XL_2_256 = dict(_class_name="Transformer2DModel", num_attention_heads=16, attention_head_dim=72, num_layers=28,
                    patch_size=2, in_channels=4, out_channels=8, sample_size=32, num_embeds_ada_norm=1000,
                    norm_type="ada_norm_zero", cross_attention_dim=None, use_linear_projection=False)  # fmt: skip


def test_the_hub_models_are_the_presets_they_are_said_to_be():
    assert init_from.preset_of("unet", GOOGLE_CIFAR10, "google/ddpm-cifar10-32") == "ddpm32"
    assert init_from.extra_settings("unet", "ddpm32", GOOGLE_CIFAR10) == dict(GOOGLE, attention_head_dim=None)
    assert init_from.preset_of("unet", GOOGLE_256, "google/ddpm-church-256") == "ref128"  # at 256px: any multiple of 32
    assert init_from.preset_of("dit", DIT_XL_2_256, "facebook/DiT-XL-2-256") == "dit-xl2"
    assert init_from.extra_settings("dit", "dit-xl2", DIT_XL_2_256) == {}


def test_a_dit_saved_as_transformer2dmodel_loads_as_a_dit(tmp_path):
    folder = tmp_path / "old"
    tiny_dit().save_pretrained(str(folder / "transformer"))
    DDPMScheduler().save_pretrained(str(folder / "scheduler"))
    saved = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps(saved | {"_class_name": "Transformer2DModel"}))
    assert resolved("--init_from", folder).model == "dit-tiny"


def test_a_conditional_run_keeps_its_labels_for_its_classes_and_an_unconditional_one_drops_them(tmp_path, capsys):
    source = tmp_path / "source"
    run(source, "--max_train_steps", 2, "--class_conditional", "--objective", "ddpm", "--ema", "none")
    capsys.readouterr()
    network, _ = rundir.load_model(source)
    classes = models.num_classes_of(network)
    kept = builder.build(resolved("--init_from", source, "--class_conditional"), 10, num_classes=classes)
    assert equal_states(kept.network.state_dict(), network.state_dict()) and "nothing adapted" in kept.started_from
    other = builder.build(resolved("--init_from", source, "--class_conditional"), 10, num_classes=classes + 1)
    null = network.class_embedding.weight[-1]  # the source's null label: every new row starts there
    assert (other.network.class_embedding.weight == null).all() and "a new label table" in other.started_from
    dropped = builder.build(resolved("--init_from", source), 10)
    assert dropped.network.class_embedding is None and "its label table dropped" in dropped.started_from
    # as many classes, other names: a new table, not the source's rows by index (train.py passes the names)
    from test_metrics import image_folder

    for name in ("ant", "bee", "cat"):
        image_folder(tmp_path / "abc" / name, n=4)
    run(tmp_path / "renamed", "--init_from", source, "--class_conditional", "--dataset", tmp_path / "abc",
        "--objective", "ddpm", "--max_train_steps", 1)  # fmt: skip
    assert "a new label table for this run's 3 classes" in capsys.readouterr().out
