"""Captions: read beside the images or from a dataset's column, encoded once by a frozen text encoder, cached.

    folder_captions(folder, paths) -> [[str]]          each image's captions: metadata.jsonl or a .txt beside it
    column_captions(dataset, requested, source) -> [[str]]   a `datasets` dataset's text column
    caption_table(per_image, first) -> (captions, choices)   the distinct captions (`first` first), the empty one last
        (the unconditional caption), and a (images, most captions) LongTensor of each image's ids, -1 padded
    load_text_encoder(id_or_path) -> TextEncoder        a transformers CLIP or T5 encoder and its tokenizer
    cached_embeddings(encoder, captions, root=None, log=print) -> Table
        Each caption encoded once, in pieces, into a folder keyed by the encoder's weights, tokenizer, length and
        dtype and by the captions: a second run (or process) reads it; a preempted encode keeps its pieces.
    Table.rows(ids, device) -> Words                    a batch's embeddings and masks, from host memory to `device`
    Draws(table, choices, seed).batch(indices, epoch, device) -> Words   each image's caption drawn, as the step takes it

Bad captions are one-line ConfigErrors before any training: an image without a caption, an empty or non-UTF-8
caption file, a metadata.jsonl line that is not JSON or names a missing file.
"""

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import NamedTuple

import torch

from ddpm_train.data import autoencoder
from ddpm_train.data import folders, keyed_random, latents
from ddpm_train.errors import ConfigError, first_line

METADATA = "metadata.jsonl"  # HF ImageFolder's: one JSON object a line, {"file_name": ..., "text": ...}
TEXT_COLUMNS = ("text", "caption", "prompt")  # a dataset's caption column, found by name
PIECE = 1024  # captions encoded and written at a time: a preempted encode keeps what it wrote
T5_LENGTH = 120  # PixArt-α's T5 tokens; a CLIP encoder takes its own 77
STORED = torch.bfloat16  # the cached embeddings' dtype: half the bytes of float32, T5's range kept
ENCODE_BATCH = 256


# --- captions in ---------------------------------------------------------------------------------


def _split_lines(text):
    return [line.strip() for line in text.splitlines() if line.strip()]


def _texts(value, where):
    """A metadata.jsonl `text`: a string or a list of strings, each a caption."""
    found = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if found is None or not all(isinstance(t, str) for t in found):
        raise ConfigError(f"{where}: `text` must be a caption or a list of captions, not {type(value).__name__}")
    found = [t.strip() for t in found if t.strip()]
    if not found:
        raise ConfigError(f"{where}: the caption is empty; write the image's caption, or leave the image out")
    return found


def _metadata(folder):
    """{image path: [captions]} from every metadata.jsonl under `folder` (each names files relative to itself)."""
    found = {}
    for meta in sorted(Path(folder).rglob(METADATA)):
        try:
            lines = meta.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise ConfigError(f"{meta} is not UTF-8 text: save it as UTF-8") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{meta} line {number}"
            try:
                row = json.loads(line)
            except ValueError:
                raise ConfigError(f"{where} is not JSON: write one {{\"file_name\": ..., \"text\": ...}} object a line") from None
            if not isinstance(row, dict) or "file_name" not in row or "text" not in row:
                raise ConfigError(f"{where} needs \"file_name\" and \"text\" (HF ImageFolder's metadata.jsonl)")
            path = (meta.parent / str(row["file_name"])).resolve()
            if not path.is_file():
                raise ConfigError(f"{where} names {row['file_name']}, which is not in {meta.parent}: fix the name or the line")
            found[path] = _texts(row["text"], where)
    return found


def _beside(path):
    """The captions of the .txt beside image `path` (one a line), or None when there is none."""
    text_file = Path(path).with_suffix(".txt")
    if not text_file.is_file():
        return None
    try:
        lines = _split_lines(text_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{text_file} is not UTF-8 text: save it as UTF-8") from None
    if not lines:
        raise ConfigError(f"{text_file} is empty: write the image's caption in it, or remove it and the image")
    return lines


def folder_captions(folder, paths):
    """Each image's captions (a list a path): its metadata.jsonl row, else the lines of the .txt beside it."""
    rows = _metadata(folder)
    per_image = [rows.get(Path(p).resolve()) or _beside(p) for p in paths]
    missing = [p for p, found in zip(paths, per_image) if not found]
    if missing:
        raise ConfigError(
            f"{len(missing)} of {len(paths)} images under {folder} have no caption (the first: {missing[0]}): give "
            f"each a line in {METADATA} or a .txt beside it, or train without --text_encoder"
        )
    return per_image


def column_captions(dataset, requested, source):
    """Each row's captions from a `datasets` dataset: the column `requested` (--caption_column), else the first of
    TEXT_COLUMNS it has; a row's value is a caption or a list of them."""
    columns = list(dataset.column_names)
    column = requested or next((c for c in TEXT_COLUMNS if c in columns), None)
    if column not in columns:
        wanted = f"no column '{requested}'" if requested else f"no {'/'.join(TEXT_COLUMNS)} column"
        raise ConfigError(f"dataset {source} has {wanted} (columns: {', '.join(columns)}); name its captions with --caption_column")
    return [_texts(value, f"dataset {source}, row {row} of column '{column}'") for row, value in enumerate(dataset[column])]


def caption_table(per_image, first=()):
    """(the distinct captions in first-seen order with the empty caption last, a LongTensor (images, most
    captions of an image) of each image's caption ids padded with -1). The empty caption's id, len(captions) - 1,
    is the unconditional one that classifier-free guidance trains with. `first`: captions that lead the table
    whether an image has them or not (a run's grid prompts: the grids take the first captions)."""
    ids, captions = {}, []
    for texts in [first or [], *per_image]:
        for text in texts:
            if text not in ids:
                ids[text] = len(captions)
                captions.append(text)
    captions.append("")
    width = max(len(texts) for texts in per_image)
    choices = torch.full((len(per_image), width), -1, dtype=torch.long)
    for row, texts in enumerate(per_image):
        choices[row, : len(texts)] = torch.tensor([ids[text] for text in texts])
    return captions, choices


# --- the encoder ---------------------------------------------------------------------------------


class TextEncoder(NamedTuple):
    tokenizer: object
    model: object  # a transformers CLIPTextModel or T5EncoderModel, frozen, in eval mode
    max_length: int  # tokens a caption is padded or cut to
    source: str


def _encoder_class(model_type, source):
    import transformers

    if model_type in ("clip", "clip_text_model"):
        return transformers.CLIPTextModel
    if model_type in ("t5", "mt5"):
        return transformers.T5EncoderModel
    if model_type == "umt5":
        return transformers.UMT5EncoderModel
    raise ConfigError(f"--text_encoder {source} is a {model_type or 'model of no model_type'}: name a CLIP or T5 text encoder")


def _places(id_or_path):
    """(encoder's, tokenizer's) folders or subfolders: the encoder's own folder, else a pipeline's text_encoder/
    and tokenizer/."""
    path = Path(id_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return (str(path), None), (str(path), None)
        if (path / "text_encoder" / "config.json").is_file():
            return (str(path), "text_encoder"), (str(path), "tokenizer")
        raise ConfigError(
            f"--text_encoder {id_or_path} holds no text encoder (no config.json, nor text_encoder/config.json): point "
            "it at a transformers CLIP or T5 encoder's folder (with its tokenizer), or at a pipeline's folder"
        )
    if str(id_or_path).startswith(("/", "./", "../", "~")):
        raise ConfigError(f"--text_encoder {id_or_path}: no such folder; check the path")
    return (str(id_or_path), None), (str(id_or_path), None)


def _config(id_or_path):
    """(encoder's config, its folder and subfolder, the tokenizer's) of `id_or_path`; no weights read."""
    import transformers

    (where, subfolder), tokenizer_place = _places(id_or_path)
    local = Path(where, subfolder or "", "config.json")
    if local.is_file():  # a folder's: what it holds, said before transformers reads it
        try:
            _encoder_class(json.loads(local.read_text()).get("model_type", ""), id_or_path)
        except (ValueError, AttributeError):
            raise ConfigError(f"--text_encoder {id_or_path}: {local} is not a JSON object; check its files") from None
    try:
        config = transformers.AutoConfig.from_pretrained(where, subfolder=subfolder or "")
    except (OSError, ValueError) as e:  # offline, or no such repository (a folder's config.json was read above)
        raise ConfigError(
            f"--text_encoder {id_or_path}: no such folder, and it cannot be had from the Hugging Face Hub "
            f"({first_line(e)}): on a machine that reaches the Hub run `hf download {id_or_path} --local-dir "
            "DIR`, copy DIR here and pass --text_encoder DIR"
        ) from None
    config = getattr(config, "text_config", config)  # a whole CLIP model's: its text tower
    _encoder_class(getattr(config, "model_type", ""), id_or_path)
    return config, (where, subfolder), tokenizer_place


def encoder_settings(id_or_path):
    """(the width of its embeddings, the tokens a caption is padded or cut to) from the encoder's config alone:
    what a run's network and FLOPs need before any weights load. A CLIP encoder takes its positions (77), a T5 one
    PixArt-α's 120 tokens."""
    config = _config(id_or_path)[0]
    width = getattr(config, "hidden_size", None) or config.d_model
    length = config.max_position_embeddings if hasattr(config, "max_position_embeddings") else T5_LENGTH
    return int(width), int(length)


def load_text_encoder(id_or_path):
    """The frozen encoder and tokenizer of `id_or_path`: a folder holding both, a pipeline's folder (text_encoder/
    and tokenizer/), or a Hub id (read from the local Hub cache when offline). One line for each bad input."""
    import transformers

    config, (where, subfolder), (tokenizer_where, tokenizer_subfolder) = _config(id_or_path)
    transformers.utils.logging.disable_progress_bar()
    try:
        model = _encoder_class(config.model_type, id_or_path).from_pretrained(where, subfolder=subfolder or "")
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_where, subfolder=tokenizer_subfolder or "")
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--text_encoder {id_or_path}: cannot load it ({first_line(e, 200)}); check its files") from None
    model.eval().requires_grad_(False)
    return TextEncoder(tokenizer, model, encoder_settings(id_or_path)[1], str(id_or_path))


def encoder_identity(encoder):
    """What the embeddings depend on: the encoder's class and weights, the tokenizer's vocabulary, the length."""
    vocab = json.dumps(sorted(encoder.tokenizer.get_vocab().items()))
    return dict(
        cls=type(encoder.model).__name__,
        weights_sha256=autoencoder.hash_tensors(sorted(encoder.model.state_dict().items())),
        tokenizer=type(encoder.tokenizer).__name__.removesuffix("Fast"),
        vocab_sha256=hashlib.sha256(vocab.encode()).hexdigest(),
        max_length=encoder.max_length,
        dtype=str(STORED).removeprefix("torch."),
    )


def _is_t5(model):
    return "T5" in type(model).__name__


@torch.no_grad()
def encode(encoder, captions, device=None):
    """(embeddings (N, max_length, D) in STORED, the mask (N, max_length) bool of the positions the network attends
    to, each caption's tokens before cutting) of `captions`, padded to the encoder's length; the empty caption too is
    encoded as it is."""
    model = encoder.model.to(device or "cpu")
    parts = []
    for start in range(0, len(captions), ENCODE_BATCH):
        batch = captions[start : start + ENCODE_BATCH]
        tokens = encoder.tokenizer(batch, padding="max_length", max_length=encoder.max_length, truncation=True,
                                   return_tensors="pt").to(model.device)  # fmt: skip
        hidden = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
        lengths = torch.tensor([len(ids) for ids in encoder.tokenizer(batch, verbose=False)["input_ids"]])
        # what the network attends to: a T5 caption's tokens (PixArt-α's mask); every CLIP position, padding too, as
        # Stable Diffusion trains and its pipeline samples
        mask = tokens.attention_mask.bool() if _is_t5(model) else torch.ones_like(tokens.attention_mask, dtype=torch.bool)
        parts.append((hidden.to("cpu", STORED), mask.cpu(), lengths))
    model.to("cpu")  # its device's memory back to training
    return tuple(torch.cat(column) for column in zip(*parts))


# --- the table a run reads ---------------------------------------------------------------------


class Words(NamedTuple):
    """A batch's captions as a captioned network reads them (its `class_labels`): (N, tokens, width) embeddings and
    the (N, tokens) bool mask of the positions it attends to, on the batch's device."""

    embeddings: torch.Tensor
    mask: torch.Tensor

    def where(self, replaced, other):
        """Row i of `other` (one row: broadcast) where `replaced[i]`, else row i of these: label dropout."""
        return Words(torch.where(replaced[:, None, None], other.embeddings, self.embeddings),
                     torch.where(replaced[:, None], other.mask, self.mask))  # fmt: skip

    def cat(self, other):
        """These rows, then `other`'s (one row: repeated as often)."""
        n = len(self.embeddings)
        return Words(torch.cat([self.embeddings, other.embeddings.expand(n, -1, -1)]),
                     torch.cat([self.mask, other.mask.expand(n, -1)]))  # fmt: skip


class Table:
    """Every caption's embeddings, held in host memory (memory-mapped from the cache's pieces, so that 100,000
    CLIP-L captions, 12 GB, cost the device nothing): `rows(ids, device)` gathers a batch's rows there and moves
    them. A network's copies (its EMA's, for grids and saving) share it rather than copy it."""

    def __init__(self, pieces, folder=None, encoded=0):
        self.pieces = pieces  # [(embeddings, mask, lengths)], each of PIECE rows but the last
        self.folder, self.encoded = folder, encoded  # where it was cached; captions this run encoded (0: all read)
        self.lengths = torch.cat([p[2] for p in pieces])  # each caption's tokens before cutting

    def __len__(self):
        return len(self.lengths)

    def __deepcopy__(self, memo):
        return self

    @property
    def nbytes(self):
        return sum(t.nbytes for p in self.pieces for t in p[:2])

    def rows(self, ids, device):
        """Words of caption ids `ids` (any device), gathered on the host and moved to `device` (pinned for a GPU)."""
        ids = torch.as_tensor(ids).reshape(-1).cpu()
        first_embeddings, first_mask, _ = self.pieces[0]
        piece_of, row_of = ids // len(first_embeddings), ids % len(first_embeddings)
        embeddings = torch.empty((len(ids), *first_embeddings.shape[1:]), dtype=first_embeddings.dtype)
        mask = torch.empty((len(ids), first_mask.shape[1]), dtype=torch.bool)
        for piece in piece_of.unique().tolist():
            here = piece_of == piece
            embeddings[here], mask[here] = self.pieces[piece][0][row_of[here]], self.pieces[piece][1][row_of[here]]
        device = torch.device(device)
        if device.type == "cuda":
            embeddings, mask = embeddings.pin_memory(), mask.pin_memory()
        return Words(embeddings.to(device, non_blocking=True), mask.to(device, non_blocking=True))

    def null(self, device):
        """The empty caption's Words (one row): the unconditional caption, the table's last."""
        return self.rows([len(self) - 1], device)

    def line(self, max_length):
        """The data line's words on the captions: how many, their mean tokens, how many were cut."""
        real = self.lengths[:-1].float()  # the last is the empty caption
        cut = int((real > max_length).sum())
        how = f"encoded {self.encoded} into" if self.encoded else "read from"
        return (f"{len(real)} distinct captions, {real.mean():.1f} tokens on average, {cut} cut at {max_length} tokens "
                f"({how} {self.folder})")  # fmt: skip


def table_of(embeddings, mask, lengths):
    """A Table of captions encoded here (sample.py's prompts), in memory."""
    return Table([(embeddings, mask, lengths)])


DRAW_SALT = 0x5EED_CA9  # the caption draw's stream, apart from a latent run's draws of the same (seed, epoch, index)


class Draws:
    """A captioned run's labels as batches.Batches hands them to the step: each image's caption drawn from its
    caption_table row by (seed, epoch, image index) alone, so that a resumed run draws what it would have, then
    looked up in the Table on the host."""

    def __init__(self, table, choices, seed):
        self.table, self.choices, self.seed = table, choices, seed

    def __len__(self):
        return len(self.choices)

    def batch(self, indices, epoch, device):
        """The Words of the images at (host) `indices` in `epoch`, on `device`."""
        rows = self.choices[indices]
        keys = keyed_random.draw_keys(self.seed ^ DRAW_SALT, epoch, indices)
        pick = keys.remainder((rows >= 0).sum(1))
        return self.table.rows(rows.gather(1, pick.unsqueeze(1)).squeeze(1), device)


# --- the cache -----------------------------------------------------------------------------------


def cached_embeddings(encoder, captions, root=None, device=None, log=print):
    """The Table of `captions` (caption_table's), from the cache folder of their key, encoding the pieces it lacks:
    with several processes, process r encodes pieces r, r + world, ... and every process's folder then holds them all
    (folders.in_every_folder: nodes with folders of their own, and a failure on one process stopping all). Each piece
    is written under a temporary name and renamed, so a preempted encode keeps its finished pieces and two runs
    writing one piece leave one whole file."""
    key = dict(encoder=encoder_identity(encoder), captions=hashlib.sha256("\n".join(captions).encode()).hexdigest(),
               count=len(captions))  # fmt: skip
    folder = latents.cache_root(root) / f"text-{latents.key_hash(key)[:32]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True))
    rank, world = folders.rank_and_world()
    starts = range(0, len(captions), PIECE)
    names = [f"piece-{start:09d}.pt" for start in starts]

    def encode_mine():
        encoded = 0
        for number, start in enumerate(starts):
            piece = folder / names[number]
            if number % world != rank or piece.is_file():
                continue
            part = encode(encoder, captions[start : start + PIECE], device)
            tmp = folder / f".{piece.name}.{uuid.uuid4().hex[:8]}"
            torch.save(part, tmp)
            os.replace(tmp, piece)
            encoded += len(captions[start : start + PIECE])
        return encoded

    encoded = encode_mine() if world == 1 else folders.in_every_folder(folder, names, encode_mine, "encode its captions")
    pieces = [torch.load(folder / name, mmap=True, weights_only=True) for name in names]
    found = Table(pieces, folder, encoded)
    if log:
        log(f"captions: {found.line(encoder.max_length)}")
    return found
