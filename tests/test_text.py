"""Training from captions (captions.py, --text_encoder): captions read and refused, a real tiny CLIP encoder written
with save_pretrained and read back by the real loading code, its embeddings cached once, a UNet that attends to
them, a run that resumes bit for bit, grids labelled by their prompts, and sample.py --prompt."""

import json
import os
import shutil
import string
from pathlib import Path

import pytest
import torch
from PIL import Image

from ddpm_train.data import captions
from ddpm_train import config
from ddpm_train.perf import flops
from ddpm_train.data import latents
from ddpm_train.networks import model as models
import sample
import train
from ddpm_train.errors import ConfigError
from test_train import run, tensors_of

COLOURS = ("red", "green", "blue", "yellow")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """A randomly initialised 2-layer CLIP text model and its tokenizer (letters, digits and punctuation, no
    merges), saved as transformers saves them (bench/labelled.py): the folder a user's `--text_encoder` names."""
    from bench import labelled

    return labelled.write_random_clip(tmp_path_factory.mktemp("clip"), positions=16)  # short: a test cuts a caption


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "cache"))  # no test reads another's, or the user's


def captioned_folder(folder, count=16):
    """`count` flat-coloured images, a metadata.jsonl giving each one caption or (odd ones) two."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        colour = COLOURS[i % len(COLOURS)]
        Image.new("RGB", (20, 18), colour).save(folder / f"{i:02d}.png")
        text = [f"a {colour} square", colour] if i % 2 else f"a {colour} square"
        rows.append(json.dumps({"file_name": f"{i:02d}.png", "text": text}))
    (folder / captions.METADATA).write_text("\n".join(rows) + "\n")
    return folder


# --- captions in ---


def test_captions_come_from_metadata_jsonl_and_from_txt_files(tmp_path):
    folder = captioned_folder(tmp_path / "set", 4)
    paths = sorted(folder.glob("*.png"))
    assert captions.folder_captions(folder, paths) == [["a red square"], ["a green square", "green"],
                                                        ["a blue square"], ["a yellow square", "yellow"]]  # fmt: skip
    (folder / captions.METADATA).unlink()
    for i, path in enumerate(paths):
        path.with_suffix(".txt").write_text(f"first {i}\n\n  second {i}  \n")
    assert captions.folder_captions(folder, paths)[3] == ["first 3", "second 3"]  # lines, stripped, blank ones left


@pytest.mark.parametrize("damage, words", [
    (lambda f: (f / "01.txt").unlink(), "1 of 4 images under"),
    (lambda f: (f / "01.txt").write_text("  \n"), "01.txt is empty"),
    (lambda f: (f / "01.txt").write_bytes(b"\xff\xfe caption"), "01.txt is not UTF-8 text"),
    (lambda f: (f / captions.METADATA).write_text('{"file_name": "07.png", "text": "x"}\n'), "names 07.png, which is not in"),
    (lambda f: (f / captions.METADATA).write_text("not json\n"), "line 1 is not JSON"),
    (lambda f: (f / captions.METADATA).write_text('{"file_name": "00.png", "text": ""}\n'), "the caption is empty"),
    (lambda f: (f / captions.METADATA).write_text('{"file_name": "00.png"}\n'), 'needs "file_name" and "text"'),
    (lambda f: (f / captions.METADATA).write_text('{"file_name": "00.png", "text": 5}\n'), "not int"),
    (lambda f: (f / captions.METADATA).write_bytes(b"\xff\xfe"), "metadata.jsonl is not UTF-8 text"),
])  # fmt: skip
def test_a_bad_caption_is_one_line_that_says_what_to_change(tmp_path, damage, words):
    folder = tmp_path / "set"
    captioned_folder(folder, 4)
    (folder / captions.METADATA).unlink()
    for path in folder.glob("*.png"):
        path.with_suffix(".txt").write_text("a caption")
    damage(folder)
    with pytest.raises(ConfigError, match=words) as e:
        captions.folder_captions(folder, sorted(folder.glob("*.png")))
    assert "\n" not in str(e.value)


def test_a_datasets_text_column_is_found_by_name_or_named():
    import datasets

    rows = datasets.Dataset.from_dict({"image": [0, 1], "caption": [["a cat"], ["a dog", "two dogs"]], "note": ["x", "y"]})
    assert captions.column_captions(rows, None, "set") == [["a cat"], ["a dog", "two dogs"]]
    assert captions.column_captions(rows, "note", "set") == [["x"], ["y"]]
    with pytest.raises(ConfigError, match="has no column 'words'.*--caption_column"):
        captions.column_captions(rows, "words", "set")
    with pytest.raises(ConfigError, match="no text/caption/prompt column"):
        captions.column_captions(rows.remove_columns("caption"), None, "set")


def test_each_of_an_images_captions_is_drawn_as_often_and_the_empty_one_is_last():
    texts, choices = captions.caption_table([["a cat"], ["a dog", "two dogs", "a cat"]])
    assert texts == ["a cat", "a dog", "two dogs", ""]
    assert choices.tolist() == [[0, -1, -1], [1, 2, 0]]
    table = captions.table_of(torch.arange(4.0).view(4, 1, 1), torch.ones(4, 1, dtype=torch.bool), torch.ones(4))
    draws = captions.Draws(table, choices.repeat(3000, 1), seed=0)  # the rows' embedding is its caption's id
    drawn = draws.batch(torch.arange(6000), 0, "cpu").embeddings.long().view(3000, 2)
    assert (drawn[:, 0] == 0).all()  # padding never drawn
    assert torch.bincount(drawn[:, 1], minlength=3).tolist() == pytest.approx([1000, 1000, 1000], abs=90)
    again = draws.batch(torch.tensor([5, 1, 3]), 0, "cpu").embeddings  # by (seed, epoch, image) alone: any batch
    assert torch.equal(again.long().flatten(), drawn.flatten()[[5, 1, 3]])
    assert not torch.equal(draws.batch(torch.arange(6000), 1, "cpu").embeddings.long().view(3000, 2), drawn)


# --- the encoder and its cache ---


def test_an_encoder_loads_from_its_folder_or_a_pipelines_and_refuses_what_is_not_one(clip, tmp_path):
    encoder = captions.load_text_encoder(str(clip))
    assert type(encoder.model).__name__ == "CLIPTextModel" and encoder.max_length == 16
    assert not encoder.model.training and not any(p.requires_grad for p in encoder.model.parameters())
    assert captions.encoder_settings(str(clip)) == (32, 16)
    pipeline = tmp_path / "pipeline"
    shutil.copytree(clip, pipeline / "text_encoder", ignore=shutil.ignore_patterns("tokenizer*"))
    shutil.copytree(clip, pipeline / "tokenizer", ignore=shutil.ignore_patterns("model*", "config.json"))
    assert captions.load_text_encoder(str(pipeline)).tokenizer("a cat").input_ids == encoder.tokenizer("a cat").input_ids
    with pytest.raises(ConfigError, match="holds no text encoder"):
        captions.load_text_encoder(str(tmp_path))
    models.build_network("tiny", 16).save_pretrained(tmp_path / "unet")
    with pytest.raises(ConfigError, match="name a CLIP or T5 text encoder"):
        captions.load_text_encoder(str(tmp_path / "unet"))
    with pytest.raises(ConfigError, match="hf download nobody/none-such"):  # offline: the tests' HF_HUB_OFFLINE
        captions.load_text_encoder("nobody/none-such")
    with pytest.raises(ConfigError, match="no such folder; check the path"):
        captions.load_text_encoder(str(tmp_path / "none-such"))
    (tmp_path / "unet" / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="config.json is not a JSON object"):
        captions.load_text_encoder(str(tmp_path / "unet"))


def write_t5(folder):
    """A randomly initialised 1-layer T5 encoder (width 16) and a Unigram tokenizer of single letters."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    letters = [("▁" * space + c, -3.0) for space in (0, 1) for c in string.ascii_lowercase]
    T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), *letters], extra_ids=0).save_pretrained(folder)
    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=56, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)).save_pretrained(folder)
    return folder


def test_a_t5_encoder_pads_to_pixart_s_length_and_masks_the_padding(tmp_path):
    """T5's embeddings are read with their tokens' mask (PixArt-α's); CLIP's at every position (Stable Diffusion's)."""
    encoder = captions.load_text_encoder(str(write_t5(tmp_path)))
    assert type(encoder.model).__name__ == "T5EncoderModel" and captions.encoder_settings(str(tmp_path)) == (16, 120)
    embeddings, mask, lengths = captions.encode(encoder, ["a cat", ""])
    assert embeddings.shape == (2, 120, 16) and mask.sum(1).tolist() == lengths.tolist() == [5, 1]  # ▁a ▁c a t </s>


def test_captions_are_encoded_once_and_a_preempted_encode_keeps_its_pieces(clip, monkeypatch):
    encoder = captions.load_text_encoder(str(clip))
    texts = [f"caption {i}" for i in range(9)] + ["x" * 30, ""]  # 10 tokens each (letters, the digit, start, end); 32
    monkeypatch.setattr(captions, "PIECE", 4)
    lines = []
    first = captions.cached_embeddings(encoder, texts, log=lines.append)
    rows = first.rows(range(11), "cpu")
    assert first.encoded == 11 and rows.embeddings.shape == (11, 16, 32) and rows.embeddings.dtype == captions.STORED
    assert first.lengths[-1] == 2 and rows.mask.all()  # the empty caption's start and end; CLIP: every position
    whole, _, _ = captions.encode(encoder, texts)
    assert torch.equal(rows.embeddings, whole)  # in pieces, as in one
    (first.folder / "piece-000000004.pt").unlink()  # as a preempted encode leaves it
    again = captions.cached_embeddings(encoder, texts, log=lines.append)
    assert again.encoded == 4 and torch.equal(again.rows(range(11), "cpu").embeddings, rows.embeddings)
    assert captions.cached_embeddings(encoder, texts, log=lines.append).encoded == 0
    assert lines[-1].startswith("captions: 10 distinct captions, 12.2 tokens on average, 1 cut at 16 tokens (read from")
    next(encoder.model.parameters()).data += 1  # other weights: another key, another folder
    assert captions.cached_embeddings(encoder, texts, log=None).folder != first.folder


# --- configuration ---


@pytest.mark.parametrize("flags, words", [
    (["--model", "edm2tiny"], "an EDM2 network cannot attend to captions yet"),
    (["--class_conditional"], "pick one"),
    (["--dataset", "shapes"], "the built-in shapes have none"),
])  # fmt: skip
def test_a_captioned_run_that_cannot_be_is_refused_in_one_line(clip, tmp_path, flags, words):
    data = captioned_folder(tmp_path / "data", 4)
    base = ["--dataset", str(data), "--text_encoder", str(clip), "--image_size", "16", "--output_dir", str(tmp_path / "o")]
    with pytest.raises(ConfigError, match=words):
        config.resolve(config.parse_args([*base, *flags]))


def test_caption_column_alone_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="add --text_encoder"):
        config.resolve(config.parse_args(["--caption_column", "text", "--output_dir", str(tmp_path)]))


def test_the_flops_count_the_cross_attention():
    plain = flops.network_flops("tiny", 16, 2)
    text = flops.network_flops("tiny", 16, 2, text=(32, 16))
    net = models.build_network("tiny", 16, text_dim=32)
    assert type(net).__name__ == "TextUNet" and text["params"] == sum(p.numel() for p in net.parameters())
    assert text["flops_fwdbwd"] > plain["flops_fwdbwd"] and flops.network_flops("tiny", 16, 2, text=(32, 8))["flops_fwd"] < text["flops_fwd"]
    dit = flops.network_flops("dit-tiny", 16, 2, text=(32, 16))
    assert dit["params"] == sum(p.numel() for p in models.build_network("dit-tiny", 16, text_dim=32).parameters())
    assert dit["flops_fwd"] > flops.network_flops("dit-tiny", 16, 2)["flops_fwd"]


def test_a_captioned_dit_reads_the_caption_in_every_block_s_adaln_not_its_cross_attention_alone(clip):
    """The pooled caption takes the class label's place in the conditioning each block's adaLN and the final layer
    read: with every cross-attention cut, two captions still give two outputs (PixArt-α's blocks, which condition
    by cross-attention alone, did not follow their prompts: docs/text.md)."""
    torch.manual_seed(0)
    net = models.build_network("dit-tiny", 16, text_dim=32)
    texts, _ = captions.caption_table([["red"], ["blue"]])
    net.captions = captions.cached_embeddings(captions.load_text_encoder(str(clip)), texts, log=None)
    for block in net.transformer_blocks:
        block.attn2 = None
    x, t = torch.randn(1, 3, 16, 16).expand(2, -1, -1, -1), torch.tensor([500, 500])
    out = net(x, t, class_labels=net.captions.rows([0, 1], "cpu"), return_dict=False)[0]
    assert not torch.allclose(out[0], out[1])


def test_every_resnet_of_a_captioned_unet_reads_the_caption_not_its_middle_alone(clip):
    """`small` has attention only in its middle: with that cross-attention cut, the caption still reaches the
    output through the time embedding (trained, its prompts were followed only so: docs/text.md)."""
    torch.manual_seed(0)
    net = models.build_network("small", 16, text_dim=32)
    texts, _ = captions.caption_table([["red"], ["blue"]])
    net.captions = captions.cached_embeddings(captions.load_text_encoder(str(clip)), texts, log=None)
    for block in net.mid_block.attentions:
        block.forward = lambda hidden_states, *args, **kwargs: (hidden_states,)
    x, t = torch.randn(1, 3, 16, 16).expand(2, -1, -1, -1), torch.tensor([500, 500])
    out = net(x, t, class_labels=net.captions.rows([0, 1], "cpu"), return_dict=False)[0]
    assert not torch.allclose(out[0], out[1])


@pytest.mark.slow
@pytest.mark.parametrize("network", ["tiny", "dit-tiny"])
@pytest.mark.parametrize("scope", ["whole", "regional"])
def test_a_compiled_captioned_network_gives_the_eager_outputs(clip, scope, network, monkeypatch):
    """Dynamo's eager backend traces the graphs as Inductor's would: the captions' Words into the forward, whole
    (one graph) and in the repeated blocks (its cross-attention's Attention among them)."""
    from ddpm_train.perf import compiling

    real = torch.compile
    monkeypatch.setattr(compiling.torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="eager", **kw))
    torch.manual_seed(0)
    net = models.build_network(network, 16, text_dim=32)
    texts, _ = captions.caption_table([["a cat"], ["a dog"]])
    net.captions = captions.cached_embeddings(captions.load_text_encoder(str(clip)), texts, log=None)
    x, t = torch.randn(3, 3, 16, 16), torch.tensor([3, 500, 900])
    words, flipped = net.captions.rows([0, 1, 2], "cpu"), net.captions.rows([2, 1, 0], "cpu")
    call = real(net, backend="eager", fullgraph=True) if scope == "whole" else compiling.RegionalNetwork(net)
    eager = net(x, t, class_labels=words, return_dict=False)[0]
    assert torch.allclose(call(x, t, class_labels=words, return_dict=False)[0], eager, atol=1e-5)
    assert not torch.allclose(eager[0], net(x, t, class_labels=flipped, return_dict=False)[0][0])  # it reads them


# --- a run ---

RUN = ["--text_encoder", "{clip}", "--dataset", "{data}", "--train_batch_size", 4, "--max_train_steps", 8,
       "--checkpointing_steps", 4, "--save_images_epochs", 100, "--eval_batch_size", 8]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("network", [["--model", "tiny"], ["--model", "dit-tiny", "--token_routing", "0.5"]])
def test_a_captioned_run_trains_resumes_bit_for_bit_and_samples_from_prompts(clip, tmp_path, capsys, network):
    data = captioned_folder(tmp_path / "data")
    flags = [str(f).format(clip=clip, data=data) for f in RUN] + network
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    config_ = run(straight, *flags)
    out = capsys.readouterr().out
    assert "captions: 6 distinct captions" in out and "(encoded 7 into" in out  # green and yellow have two
    assert config_["num_captions"] == 6 and config_["text_dim"] == 32 and config_["num_classes"] == 0
    grid = sorted((straight / "samples").glob("*.txt"))[-1].read_text().splitlines()
    assert grid == ["row 1: a red square", "row 2: green", "row 3: a yellow square"]  # the captions spread over the rows
    assert "text-to-image" in (straight / "README.md").read_text() and not (straight / "model_index.json").exists()
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-4", resumed / "checkpoints" / "checkpoint-4")
    run(resumed, *flags)
    out = capsys.readouterr().out
    assert "(read from" in out and "resumed from" in out  # the second run encodes nothing
    a, _ = tensors_of(straight / "unet")
    b, _ = tensors_of(resumed / "unet")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    assert any("attn2.to_k" in k for k in a)  # cross-attention, trained
    written = tmp_path / "samples"
    sample.main(sample.parse_args([str(straight), "--prompt", "a red square", "--prompt", "blue", "--num_images", "2",
                                   "--guidance_scale", "3", "--num_inference_steps", "2", "--output", str(written),
                                   "--no-copies", "--device", "cpu"]))  # fmt: skip
    assert (written / "000001.png").is_file()
    with pytest.raises(SystemExit):
        sample.main(sample.parse_args([str(straight), "--num_images", "1", "--output", str(tmp_path / "x"), "--device", "cpu"]))
    assert "trained from captions: say what to draw with --prompt" in capsys.readouterr().err


def test_a_captioned_run_s_fid_samples_ask_for_its_images_captions(clip, tmp_path, monkeypatch):
    """The evaluation draws its samples from captions as the data holds them (each image's first), never the empty
    one, and scores them."""
    from ddpm_train.evaluation import metrics
    from test_metrics import TinyFeatures

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    asked, real = [], train.sampling.generate_batches
    monkeypatch.setattr(train.sampling, "generate_batches", lambda *a, **kw: asked.append(a[7]) or real(*a, **kw))
    (tmp_path / "inception.pth").touch()
    flags = [str(f).format(clip=clip, data=captioned_folder(tmp_path / "data")) for f in RUN]
    run(tmp_path / "run", *flags, "--max_train_steps", 4, "--eval_every_epochs", 1, "--eval_num_samples", 6,
        "--fid_weights", tmp_path / "inception.pth")  # fmt: skip
    texts, _ = captions.caption_table(captions.folder_captions(tmp_path / "data", sorted((tmp_path / "data").glob("*.png"))))
    firsts = {texts.index(f"a {c} square") for c in COLOURS}
    labels = [a for a in asked if a is not None and len(a) == 6][0]  # the evaluation's (the grid asks its rows)
    assert set(labels.tolist()) <= firsts and len(set(labels.tolist())) > 1
    (result,) = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    assert result["num_images"] == 6 and result["fid"] >= 0


def test_a_config_file_s_grid_prompts_are_the_grid_s_rows_and_are_refused_where_they_cannot_be(clip, tmp_path, capsys):
    data, file = captioned_folder(tmp_path / "data", 4), tmp_path / "run.yaml"
    file.write_text('grid_prompts: ["a purple square", "a red square"]\n')
    flags = [str(f).format(clip=clip, data=data) for f in RUN]
    config_ = run(tmp_path / "run", "--config", file, *flags, "--max_train_steps", 1, "--checkpointing_steps", 1)
    grid = sorted((tmp_path / "run" / "samples").glob("*.txt"))[-1].read_text().splitlines()
    assert grid[:3] == ["row 1: a purple square", "row 2: a red square", "row 3: a purple square"]
    assert config_["grid_prompts"] == ["a purple square", "a red square"] and "(encoded 8 into" in capsys.readouterr().out  # 6 + its own + ""
    for text, words in [("grid_prompts: a cat\n", "grid_prompts takes a list of captions"),
                        ('grid_prompts: ["a cat"]\ndataset: shapes\n', "grid_prompts are a captioned run's")]:  # fmt: skip
        file.write_text(text)
        with pytest.raises(SystemExit):
            run(tmp_path / "refused", "--config", file)
        assert words in capsys.readouterr().err


def test_prompts_are_for_a_captioned_run_and_a_prompt_file_must_be_readable(tmp_path):
    args = sample.parse_args(["run", "--prompt", "a cat"])
    with pytest.raises(ConfigError, match="--prompt is for a run trained from captions"):
        sample.labels_of(args, {"objective": "flow"}, models.build_network("tiny", 16))
    args = sample.parse_args(["run", "--prompt_file", str(tmp_path / "none.txt")])
    with pytest.raises(ConfigError, match="none.txt: cannot read it as UTF-8 text"):
        sample.labels_of(args, {"text_encoder": "unread"}, None)


@pytest.mark.slow
def test_two_processes_train_a_captioned_run_as_one(clip, tmp_path):
    """Two gloo processes: both read the captions' cache (rank 0 encoded its one piece; the other waited at the
    barrier), each draws its own σ and images, the gradients are averaged, rank 0 alone saves."""
    from test_flow import assert_trained_as_one, two_flow_ranks
    from test_train import TINY

    data, out = captioned_folder(tmp_path / "data"), tmp_path / "run"
    flags = [str(f).format(clip=clip, data=data) for f in RUN]
    ranks, events = two_flow_ranks(tmp_path, [*TINY, *flags, "--max_train_steps", 3, "--output_dir", out, "--logger", "none"])  # the last wins
    assert ranks.codes == [0, 0], ranks
    assert_trained_as_one(events, steps=3)
    assert ranks.out0.count("captions: 6 distinct captions") == 1 and "(encoded 7 into" in ranks.out0
    assert type(models.load_network(out / "unet")).__name__ == "TextUNet"


@pytest.mark.slow
def test_a_captioned_run_on_latents_reads_each_latent_s_captions_by_its_image_and_resumes_bit_for_bit(clip, tmp_path, capsys):
    """The latents keep their images' indices: an unreadable image is left out of the cache, and the images after it
    keep their own captions. Resumed, it draws the captions the run would have."""
    from test_latents import make_kl

    data = captioned_folder(tmp_path / "data")
    (data / "05.png").write_bytes(b"not a png")  # its latent missing: every later row one place up
    flags = [str(f).format(clip=clip, data=data) for f in RUN] + ["--vae", make_kl(tmp_path / "vae"), "--checkpointing_steps", 1]
    found = []
    real = train.set_up_data
    with pytest.MonkeyPatch.context() as m:
        m.setattr(train, "set_up_data", lambda *a: found.append(real(*a)) or found[-1])
        config_ = run(tmp_path / "run", *flags, "--max_train_steps", 2)
    assert config_["latents"] and config_["num_captions"] == 6 and "captions: 6 distinct" in capsys.readouterr().out
    texts, choices = captions.caption_table(captions.folder_captions(data, sorted(data.glob("*.png"))))
    kept = [i for i in range(16) if i != 5]
    assert torch.equal(found[0].labels, choices[kept])  # row r: image kept[r]'s captions
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "run" / "checkpoints" / "checkpoint-1", resumed / "checkpoints" / "checkpoint-1")
    run(resumed, *flags, "--max_train_steps", 2)
    a, _ = tensors_of(tmp_path / "run" / "unet")
    b, _ = tensors_of(resumed / "unet")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)


def test_a_ddpm_run_on_a_vae_s_latents_with_clip_saves_a_stable_diffusion_pipeline(clip, tmp_path):
    """Stable Diffusion's recipe (a UNet on latents scaled by the VAE's scaling_factor, a CLIP encoder, DDPM): the
    run saves diffusers' StableDiffusionPipeline, which generates from a prompt; sample.py reads it too."""
    from diffusers import StableDiffusionPipeline
    from test_latents import make_kl

    data, out = captioned_folder(tmp_path / "data"), tmp_path / "run"
    flags = [str(f).format(clip=clip, data=data) for f in RUN]
    run(out, *flags, "--vae", make_kl(tmp_path / "vae", scaling_factor=0.5), "--objective", "ddpm", "--max_train_steps", 2)
    pipeline = StableDiffusionPipeline.from_pretrained(out)
    images = pipeline("a red square", num_inference_steps=2, guidance_scale=3, output_type="np").images
    assert images.shape == (1, 16, 16, 3) and "StableDiffusionPipeline.from_pretrained" in (out / "README.md").read_text()
    written = tmp_path / "samples"
    sample.main(sample.parse_args([str(out), "--prompt", "green", "--num_images", "1", "--num_inference_steps", "2",
                                   "--output", str(written), "--no-copies", "--device", "cpu"]))  # fmt: skip
    assert (written / "000000.png").is_file()
    # with flow matching (its scheduler has no init_noise_sigma for the pipeline), the network alone
    run(tmp_path / "flow", *flags, "--vae", make_kl(tmp_path / "vae"), "--max_train_steps", 2)
    assert not (tmp_path / "flow" / "model_index.json").exists() and (tmp_path / "flow" / "unet").is_dir()


def test_the_labelled_set_s_captions_are_its_class_names_in_templates(tmp_path):
    from bench import labelled

    for name in ("cat", "coins"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "train" / name / "0000.png")
    assert labelled.write_captions(tmp_path) == 2
    paths = sorted((tmp_path / "train").glob("*/*.png"))
    assert captions.folder_captions(tmp_path / "train", paths)[1] == [t.format("coins") for t in labelled.TEMPLATES]


def test_a_ddpm_dit_on_a_vae_s_latents_with_t5_saves_its_network_for_sample_py(tmp_path):
    """PixArt-α's recipe (a DiT, a T5 encoder, DDPM on latents) on the project's DiT, which no diffusers pipeline
    holds: the run saves the network alone, saved as a DiT (never as diffusers' DiTTransformer2DModel, which would
    load it without its captions' layers), and its card sends the user to sample.py, which draws from a prompt."""
    from test_latents import make_kl

    data, out = captioned_folder(tmp_path / "data"), tmp_path / "run"
    flags = [str(f).format(clip=write_t5(tmp_path / "t5"), data=data) for f in RUN]
    run(out, *flags, "--model", "dit-tiny", "--vae", make_kl(tmp_path / "vae", scaling_factor=0.5), "--objective", "ddpm",
        "--max_train_steps", 2)  # fmt: skip
    assert not (out / "model_index.json").exists() and "sample.py" in (out / "README.md").read_text()
    assert json.loads((out / "unet" / "config.json").read_text())["_class_name"] == "DiT"
    sample.main(sample.parse_args([str(out), "--prompt", "green", "--num_images", "1", "--num_inference_steps", "2",
                                   "--output", str(tmp_path / "drawn"), "--no-copies", "--device", "cpu"]))  # fmt: skip
    assert (tmp_path / "drawn" / "000000.png").is_file()


def test_a_saved_datasets_dataset_trains_from_its_caption_column_with_edm(clip, tmp_path, capsys):
    """A Hub-layout dataset (save_to_disk): its `caption` column found by name; EDM's objective calls the network
    as the others do."""
    import datasets

    colours = [COLOURS[i % 4] for i in range(8)]
    rows = datasets.Dataset.from_dict({"image": [Image.new("RGB", (16, 16), c) for c in colours],
                                       "caption": [f"a {c} square" for c in colours]},
                                      features=datasets.Features(image=datasets.Image(), caption=datasets.Value("string")))  # fmt: skip
    rows.save_to_disk(str(tmp_path / "saved"))
    flags = [str(f).format(clip=clip, data=tmp_path / "saved") for f in RUN]
    config_ = run(tmp_path / "run", *flags, "--objective", "edm", "--max_train_steps", 2)
    assert config_["num_captions"] == 4 and "captions: 4 distinct captions" in capsys.readouterr().out
    assert (tmp_path / "run" / "unet" / "config.json").is_file()
    sample.main(sample.parse_args([str(tmp_path / "run"), "--prompt", "a blue square", "--num_images", "1",
                                   "--num_inference_steps", "2", "--output", str(tmp_path / "drawn"), "--no-copies",
                                   "--device", "cpu"]))  # fmt: skip
    assert (tmp_path / "drawn" / "000000.png").is_file()


# --- the captioned path's edges (issue 87) ---


def test_a_captioned_run_autoguides_with_a_captioned_guide_and_refuses_one_of_another_encoder(clip, tmp_path, capsys):
    """sample.py --guide on a captioned run: the guide reads the prompts' embeddings as the model does; a guide
    trained on another text encoder (its embeddings mean something else) is refused in one line, exit 2."""
    data = captioned_folder(tmp_path / "data", 4)
    flags = [str(f).format(clip=clip, data=data) for f in RUN]
    run(tmp_path / "main", *flags, "--max_train_steps", 2, "--checkpointing_steps", 2)
    run(tmp_path / "guide", *flags, "--max_train_steps", 1, "--checkpointing_steps", 1)
    drawn = tmp_path / "drawn"
    ask = [str(tmp_path / "main"), "--prompt", "red", "--num_images", "2", "--num_inference_steps", "2",
           "--guidance_scale", "2", "--no-copies", "--device", "cpu"]  # fmt: skip
    sample.main(sample.parse_args([*ask, "--guide", str(tmp_path / "guide"), "--output", str(drawn)]))
    assert (drawn / "000001.png").is_file()
    from bench import labelled

    other = labelled.write_random_clip(tmp_path / "clip2", seed=1, positions=16)
    run(tmp_path / "other", *[str(f).format(clip=other, data=data) for f in RUN], "--max_train_steps", 1,
        "--checkpointing_steps", 1)  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        sample.main(sample.parse_args([*ask, "--guide", str(tmp_path / "other"), "--output", str(tmp_path / "x")]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "same text encoder" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_captioned_ddpm_run_predicts_v_as_a_class_conditional_one_does(clip, tmp_path):
    data = captioned_folder(tmp_path / "data", 4)
    base = ["--dataset", str(data), "--image_size", "16", "--model", "tiny", "--objective", "ddpm", "--output_dir", str(tmp_path / "o")]
    assert config.resolve(config.parse_args(base)).prediction_type == "epsilon"
    assert config.resolve(config.parse_args([*base, "--text_encoder", str(clip)])).prediction_type == "v_prediction"


def mapped_from(tensor, file):
    """Whether `tensor`'s memory lies in a mapping of `file` (memory-mapped, not read into memory)."""
    for line in open("/proc/self/maps"):
        low, high = (int(a, 16) for a in line.split()[0].split("-"))
        if low <= tensor.data_ptr() < high:
            return line.rstrip().endswith(str(file))
    return False


def test_the_caption_table_stays_in_host_memory_memory_mapped_shared_by_copies_and_counted(clip, tmp_path, capsys):
    """The table is read from its cache's pieces as mappings of the files; the network's deep copies (its EMA's, for
    grids and saving) hold the same table, not a copy; the memory line says its size; a batch's rows reach the step
    as Words."""
    import copy

    encoder = captions.load_text_encoder(str(clip))
    table = captions.cached_embeddings(encoder, [f"caption {i}" for i in range(5)] + [""], log=None)
    assert mapped_from(table.pieces[0][0], table.folder / "piece-000000000.pt")
    net = models.build_network("tiny", 16, text_dim=32)
    net.captions = table
    assert copy.deepcopy(net).captions is table
    data = captioned_folder(tmp_path / "data", 4)
    seen = []
    real = train.step.TrainStep.descend
    with pytest.MonkeyPatch.context() as m:
        m.setattr(train.step.TrainStep, "descend", lambda self, batches, n=None: seen.append(batches[0]) or real(self, batches, n))
        run(tmp_path / "run", *[str(f).format(clip=clip, data=data) for f in RUN], "--max_train_steps", 1)
    out = capsys.readouterr().out
    memory_line = next(line for line in out.splitlines() if line.startswith("memory: weights"))
    assert "the caption table: " in memory_line and "GiB in host memory (memory-mapped)" in memory_line
    images, words = seen[0]
    assert isinstance(words, captions.Words) and words.embeddings.shape == (4, 16, 32)


def test_the_pooled_caption_reads_the_real_tokens_alone():
    """A T5 caption's padding (its mask's False positions) changes nothing the pooled caption gives; with every
    position real the pooling is diffusers' TextTimeEmbedding's own."""
    from ddpm_train.networks import dit
    from diffusers.models.embeddings import TextTimeEmbedding

    torch.manual_seed(0)
    pool = TextTimeEmbedding(32, 48, num_heads=4)
    words, mask = torch.randn(2, 10, 32), torch.ones(2, 10, dtype=torch.bool)
    assert torch.allclose(dit.pooled_caption(pool, words, mask), pool(words), atol=1e-5)
    mask[:, 4:] = False
    padded = words.clone()
    padded[:, 4:] = torch.randn(2, 6, 32) * 5
    assert torch.allclose(dit.pooled_caption(pool, words, mask), dit.pooled_caption(pool, padded, mask), atol=1e-5)
    assert torch.allclose(dit.pooled_caption(pool, words, mask), pool(words[:, :4]), atol=1e-5)


@pytest.mark.parametrize("network", ["tiny", "dit-tiny"])
def test_a_captioned_network_reads_neither_the_padding_nor_its_values(network):
    """Both the cross-attention and the pooled caption skip a caption's padding (a T5 caption's mask): what the
    padded positions hold changes nothing the network gives."""
    torch.manual_seed(0)
    net = models.build_network(network, 16, text_dim=32).eval()
    embeddings, mask = torch.randn(2, 12, 32), torch.ones(2, 12, dtype=torch.bool)
    mask[:, 5:] = False
    padded = embeddings.clone()
    padded[:, 5:] = torch.randn(2, 7, 32) * 5
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 700])
    with torch.no_grad():
        a = net(x, t, class_labels=captions.Words(embeddings, mask), return_dict=False)[0]
        b = net(x, t, class_labels=captions.Words(padded, mask), return_dict=False)[0]
    assert torch.allclose(a, b, atol=1e-5)


def _encode_on_two_nodes(spec):
    """A forked process of test_two_nodes_...: joins a gloo group of two, its own cache folder (a node's disk),
    encodes the captions (rank 1 failing where told), and writes what it read or the error it stopped with."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    rank, out = spec["rank"], Path(spec["out"])
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))  # fmt: skip
        os.environ[latents.CACHE_ENV] = str(out / f"node{rank}")
        captions.PIECE = 2
        encoder = captions.load_text_encoder(spec["clip"])
        if spec["fail"] and rank == 1:
            captions.encode = lambda *a, **kw: (_ for _ in ()).throw(ValueError("the encoder ran out of memory"))
        try:
            table = captions.cached_embeddings(encoder, spec["texts"], log=None)
            torch.save(dict(rows=table.rows(range(len(spec["texts"])), "cpu"), encoded=table.encoded,
                            pieces=sorted(p.name for p in table.folder.glob("piece-*"))), out / f"rank{rank}.pt")  # fmt: skip
        except Exception as e:
            (out / f"rank{rank}.error").write_text(f"{type(e).__name__}: {e}")
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True])
def test_two_nodes_with_their_own_cache_folders_each_end_with_every_caption_and_a_failure_stops_both(clip, tmp_path, fail):
    """Two gloo processes, each with its own cache folder (the environment variable that moves the cache): each
    encodes its pieces, and each folder then holds all of them (the other's sent over), the table the one-process
    table; where one process fails while encoding, both stop with an error rather than the other waiting."""
    import multiprocessing

    from test_latents_dist import free_port

    texts = [f"caption {i}" for i in range(6)] + [""]  # 4 pieces of 2: rank 0 encodes pieces 0 and 2, rank 1 1 and 3
    spec = dict(port=free_port(), out=str(tmp_path), clip=str(clip), texts=texts, fail=fail)
    procs = [multiprocessing.get_context("fork").Process(target=_encode_on_two_nodes, args=(dict(spec, rank=r),)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, (tmp_path / "rank0.err").read_text() if (tmp_path / "rank0.err").exists() else p.exitcode
    if fail:
        assert (tmp_path / "rank1.error").read_text() == "ValueError: the encoder ran out of memory"
        assert "rank 1 could not encode its captions" in (tmp_path / "rank0.error").read_text()
        return
    whole, mask, _ = captions.encode(captions.load_text_encoder(str(clip)), texts)
    for rank in range(2):
        found = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert found["pieces"] == [f"piece-{s:09d}.pt" for s in (0, 2, 4, 6)] and found["encoded"] == [4, 3][rank]
        assert torch.equal(found["rows"].embeddings, whole) and torch.equal(found["rows"].mask, mask)
