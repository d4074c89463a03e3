"""Diffusion transformers: DiT (Peebles & Xie 2023) and SiT (Ma et al. 2024, DiT trained with flow)
on diffusers' `DiTTransformer2DModel`, at the papers' exact sizes.

diffusers' model is the paper's network but for two things, both changed here:
  - every block builds its own timestep and label embedder (`norm1.emb`); the paper has one,
    shared by all blocks and the final layer. `DiT` ties them: each block's `norm1.emb` is
    the same module, so XL/2 has the paper's 674,834,720 trainable parameters, not
    749,826,464. A saved `DiT` holds one copy per block, all equal, so that
    `DiTTransformer2DModel.from_pretrained(run)` loads it and computes the same outputs;
    `DiT.from_pretrained` ties them again. Its state dict (a checkpoint's) holds the tied
    embedder once, under block 0's names, and loading fills it in for the other blocks.
  - each block's embedder drops labels at random while training (class_dropout_prob 0.1,
    independently per block). Here label dropout is done once per image in the training
    loop (train.py's label_dropout, the null label = num_classes, as DiT's own code), so the
    embedders' is switched off. The null label's row is kept: it is DiT's 1001st class.
An unconditional network has one class, 0, which every image gets.

The forward pass has UNet2DModel's signature: `timestep` may be a number or one per image,
`class_labels` may be None (the null label for a conditional network, class 0 otherwise).

`sample_size` may be [height, width], as a UNet2DModel's: the patches' positions are then the fixed
sine-cosine embedding of their rows and columns (a square's is diffusers' own), and the forward pass,
diffusers' but for its output, puts the patches back in rows and columns (diffusers' assumes a square).
diffusers' DiTTransformer2DModel loads only a square network.

A captioned DiT (`text_dim` > 0, --text_encoder) takes caption ids for labels: it attends to the caption's tokens in
every block, and its pooled caption stands where the class label's embedding does (DiT._read_captions). diffusers has
no class for it: it is saved as DiT.

Token routing (TREAD, Krause et al. 2025; --token_routing): while training, a random share of each image's
tokens skips from an early block to a late one and rejoins there unchanged; the others go through. The
count routed is fixed (static shapes for compile and CUDA graphs) and drawn on the device. Sampling, and
anything run without gradients or in eval mode (the EMA copy), sees every token through every block.
"""

import argparse
import copy
import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from diffusers import DiTTransformer2DModel
from diffusers.configuration_utils import register_to_config
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import PixArtAlphaTextProjection, TextTimeEmbedding, get_2d_sincos_pos_embed_from_grid
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ddpm_train.errors import ConfigError

# (layers, hidden size, heads) of DiT's Table 1; the MLP is 4x wide, heads are 64 wide but XL's 72.
SIZES = {"s": (12, 384, 6), "b": (12, 768, 12), "l": (24, 1024, 16), "xl": (28, 1152, 16)}
PATCHES = (2, 4, 8)


def pooled_caption(embedding, words, mask):
    """diffusers' TextTimeEmbedding `embedding` (attention pooling: Imagen's pooled text) of `words` (N, tokens, width)
    over each caption's real tokens (`mask`, N x tokens bool) alone: padding (most of a T5 caption's 120 positions)
    joins neither the mean that forms the query nor the attention. With every position real it is diffusers' own."""
    pool, x = embedding.pool, embedding.norm1(words)
    n, _, width = x.shape
    real = mask.to(x.dtype).unsqueeze(-1)
    token = (x * real).sum(1, keepdim=True) / real.sum(1, keepdim=True).clamp(min=1) + pool.positional_embedding.to(x.dtype)
    x = torch.cat([token, x], 1)
    heads = lambda y: y.view(n, -1, pool.num_heads, pool.dim_per_head).transpose(1, 2)  # noqa: E731
    attend = torch.cat([torch.ones_like(mask[:, :1]), mask], 1)[:, None, None, :]  # the pooled token and the real ones
    a = F.scaled_dot_product_attention(heads(pool.q_proj(token)), heads(pool.k_proj(x)), heads(pool.v_proj(x)), attn_mask=attend)
    return embedding.norm2(embedding.proj(a.transpose(1, 2).reshape(n, width)))


class Routing(NamedTuple):
    """--token_routing: the share of tokens routed, from block `first` to block `last` (0-based, inclusive)."""

    share: float
    first: int
    last: int

    def words(self, depth):
        return f"token routing: {self.share:.0%} of the tokens skip blocks {self.first + 1}-{self.last + 1} of {depth}"


def _routing_parts(text):
    """(share, (first, last) counted from 1 or None) of --token_routing's `text`; ValueError where it is neither
    SHARE in [0, 1) nor SHARE:FIRST-LAST with 1 <= FIRST <= LAST."""
    share, _, blocks = str(text).partition(":")
    first_last = tuple(int(b) for b in blocks.split("-")) if blocks else None
    if not 0 <= float(share) < 1 or first_last and not (len(first_last) == 2 and 1 <= first_last[0] <= first_last[1]):
        raise ValueError(text)
    return float(share), first_last


def routing_flag(text):
    """--token_routing's value as typed, checked: SHARE in [0, 1) or SHARE:FIRST-LAST (blocks from 1)."""
    try:
        share, blocks = _routing_parts(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a share in [0, 1), or SHARE:FIRST-LAST with blocks counted from 1 "
                                         f"(got '{text}')") from None  # fmt: skip
    return str(text) if blocks else share


def routing(text, depth):
    """The Routing --token_routing `text` asks of `depth` blocks, or None (share 0). Without blocks: TREAD's,
    from the 3rd block to the 11th of DiT-B's 12 (CompVis/tread), scaled to `depth`. ConfigError: a block past it."""
    share, blocks = _routing_parts(text)
    if share == 0:
        return None
    if blocks:
        first, last = (b - 1 for b in blocks)
    else:
        first = min(max(1, round(depth / 6)), depth - 1)
        last = max(first, depth - 1 - max(1, round(depth / 12)))
    if last >= depth:
        raise ConfigError(f"--token_routing {text}: this network has blocks 1 to {depth}")
    return Routing(share, first, last)


def dit_kwargs(size, patch):
    layers, hidden, heads = SIZES[size]
    return dict(num_layers=layers, num_attention_heads=heads, attention_head_dim=hidden // heads, patch_size=patch)


class DiT(DiTTransformer2DModel):
    """DiTTransformer2DModel with one shared embedder, no per-block label dropout, and UNet2DModel's call."""

    # The blocks compiled once and reused (regional compilation, compiling.RegionalNetwork); diffusers 0.42.1
    # leaves DiTTransformer2DModel's list empty.
    _repeated_blocks = ("BasicTransformerBlock",)
    # A saved network's embedders of the blocks after the first (all equal to block 0's) are not in the state
    # dict, which holds the tied one once (_tied_held_once): from_pretrained loads block 0's and says nothing
    _keys_to_ignore_on_load_unexpected = (r"^transformer_blocks\.[1-9][0-9]*\.norm1\.emb\.",)
    captions = None  # a captioned DiT's caption table (captions.Table), set as model.TextUNet's; never saved

    @register_to_config
    def __init__(
        self, num_classes=None, num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=None,
        num_layers=28, dropout=0.0, norm_num_groups=32, attention_bias=True, sample_size=32, patch_size=2,
        activation_fn="gelu-approximate", num_embeds_ada_norm=None, upcast_attention=False, norm_type="ada_norm_zero",
        norm_elementwise_affine=False, norm_eps=1e-5, text_dim=0,
    ):  # fmt: skip
        # DiTTransformer2DModel's arguments (its config keys, so that it loads what this saves), and
        # num_classes: 0 unconditional (one class), else the classes; None (a plain DiTTransformer2DModel's
        # config, e.g. facebook/DiT-XL-2-256): its num_embeds_ada_norm; text_dim > 0: captioned (_read_captions)
        if num_classes is None:
            num_classes = num_embeds_ada_norm or 0
        height, width = (sample_size, sample_size) if isinstance(sample_size, int) else sample_size
        super().__init__(
            num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim, in_channels=in_channels,
            out_channels=out_channels, num_layers=num_layers, dropout=dropout, norm_num_groups=norm_num_groups,
            attention_bias=attention_bias, sample_size=height, patch_size=patch_size,
            activation_fn=activation_fn, num_embeds_ada_norm=max(num_classes, 1), upcast_attention=upcast_attention,
            norm_type=norm_type, norm_elementwise_affine=norm_elementwise_affine, norm_eps=norm_eps,
        )  # fmt: skip
        self.register_to_config(num_classes=num_classes, num_embeds_ada_norm=max(num_classes, 1), sample_size=sample_size,
                                text_dim=text_dim)  # fmt: skip
        if width != height:  # diffusers' PatchEmbed holds a square's positions
            embed = self.pos_embed
            self.width, embed.height, embed.width = width, height // patch_size, width // patch_size
            embed.register_buffer("pos_embed", positions(self.inner_dim, embed.height, embed.width), persistent=False)
        if text_dim:
            self._read_captions(text_dim)
        self._tie()
        self.routing = None  # a Routing while training with --token_routing (builder.build)
        self.register_state_dict_post_hook(_tied_held_once)
        self.register_load_state_dict_pre_hook(_tied_filled_in)

    def _read_captions(self, text_dim):
        """A captioned DiT: the caption's tokens projected to the blocks' width once (PixArt-α's projection), each
        block attending to them (cross-attention after the self-attention, as PixArt-α's), and the caption pooled by
        attention in the class label's place in the adaLN conditioning every block and the final layer read (the
        UNet's pooled caption, diffusers' "text" addition embedding). Its `class_labels` are captions.Words, as
        model.TextUNet's."""
        dim, heads = self.inner_dim, self.config.num_attention_heads
        self.caption_projection = PixArtAlphaTextProjection(text_dim, dim)
        self.caption_pool = TextTimeEmbedding(dim, dim, num_heads=heads)
        self.transformer_blocks[0].norm1.emb.class_embedder = torch.nn.Identity()  # the pooled caption, as it is
        for block in self.transformer_blocks:
            block.norm2 = torch.nn.LayerNorm(dim, self.config.norm_eps, self.config.norm_elementwise_affine)
            block.attn2 = Attention(dim, cross_attention_dim=dim, heads=heads, dim_head=dim // heads,
                                    bias=self.config.attention_bias)  # fmt: skip

    def _tie(self):
        shared = self.transformer_blocks[0].norm1.emb
        if not self.config.text_dim:
            shared.class_embedder.dropout_prob = 0.0  # train.py drops labels, once per image
        for block in self.transformer_blocks[1:]:
            block.norm1.emb = shared

    def _tied_blocks(self, prefix):
        """The state dict's name of each block after the first whose embedder is the first block's."""
        shared = self.transformer_blocks[0].norm1.emb
        return [f"{prefix}transformer_blocks.{i}.norm1.emb." for i, block in enumerate(self.transformer_blocks)
                if i > 0 and block.norm1.emb is shared]  # fmt: skip

    def forward(self, sample, timestep, class_labels=None, return_dict=True, cross_attention_kwargs=None):
        timestep = torch.as_tensor(timestep, device=sample.device)
        timestep = timestep.reshape(-1).expand(len(sample)) if timestep.numel() == 1 else timestep.reshape(-1)
        if class_labels is None:  # conditional: the null label (no class); unconditional: its one class
            fill = self.config.num_classes if self.config.num_classes else 0
            class_labels = torch.full((len(sample),), fill, dtype=torch.long, device=sample.device)
        elif not self.config.text_dim:
            class_labels = class_labels.reshape(-1)
        labels, p, channels = class_labels, self.patch_size, self.out_channels
        words = words_mask = None
        if self.config.text_dim:  # the caption's tokens to attend to (the mask as a bias, PixArt's), pooled as the label
            words = self.caption_projection(class_labels.embeddings.to(sample.dtype))
            labels = pooled_caption(self.caption_pool, words, class_labels.mask)
            words_mask = ((~class_labels.mask).to(sample.dtype) * -10000.0).unsqueeze(1)
        rows, columns = sample.shape[-2] // p, sample.shape[-1] // p
        x = self.pos_embed(sample)
        route = self.routing if self.training and torch.is_grad_enabled() else None
        for i, block in enumerate(self.transformer_blocks):
            if route and i == route.first:  # the kept tokens go on; the others wait here, as they are
                waiting, kept = x, kept_tokens(x, route.share)
                x = x.gather(1, kept)
            inputs = (x, None, words, words_mask, timestep, cross_attention_kwargs, labels)
            checkpointed = torch.is_grad_enabled() and self.gradient_checkpointing
            x = self._gradient_checkpointing_func(block, *inputs) if checkpointed else block(*inputs)
            if route and i == route.last:
                x = waiting.scatter(1, kept, x)
        conditioning = self.transformer_blocks[0].norm1.emb(timestep, labels, hidden_dtype=x.dtype)
        shift, scale = self.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        x = self.proj_out_2(self.norm_out(x) * (1 + scale[:, None]) + shift[:, None])
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(-1, rows, columns, p, p, channels))
        output = x.reshape(-1, channels, rows * p, columns * p)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def save_pretrained(self, *args, **kwargs):
        """One embedder per block on disk, all equal: DiTTransformer2DModel's layout (safetensors
        refuses tensors that share memory)."""
        shared = self.transformer_blocks[0].norm1.emb
        for block in self.transformer_blocks[1:]:
            block.norm1.emb = copy.deepcopy(shared)
        try:
            result = super().save_pretrained(*args, **kwargs)
        finally:
            for block in self.transformer_blocks[1:]:
                block.norm1.emb = shared
        config = Path(args[0] if args else kwargs["save_directory"]) / self.config_name
        saved = json.loads(config.read_text())  # the class diffusers knows (num_classes: an extra key it ignores)
        if not saved.pop("text_dim"):  # a captioned DiT is none of diffusers': saved as DiT
            config.write_text(json.dumps(saved | {"_class_name": DiTTransformer2DModel.__name__}, indent=2, sort_keys=True) + "\n")
        return result

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        net = super().from_pretrained(*args, **kwargs)
        net._tie()  # the loader may have replaced the tied module's tensors one block at a time
        return net


def kept_tokens(x, share):
    """The gather index (batch, kept, width) of the tokens of `x` (batch, tokens, width) that go through the routed
    blocks: a random set of each image's, all but int(tokens x share), drawn on x's device."""
    batch, tokens, width = x.shape
    kept = torch.rand(batch, tokens, device=x.device).argsort(dim=1)[:, : tokens - int(tokens * share)]
    return kept.unsqueeze(-1).expand(-1, -1, width)


def positions(dim, rows, columns):
    """The fixed sine-cosine embedding (1, rows x columns, dim) of a grid of patches, row by row, at whole-patch
    positions: half its channels the column's, half the row's, as diffusers' get_2d_sincos_pos_embed on a square."""
    grid = torch.meshgrid(torch.arange(columns, dtype=torch.float32), torch.arange(rows, dtype=torch.float32), indexing="xy")
    return get_2d_sincos_pos_embed_from_grid(dim, torch.stack(grid)).float().unsqueeze(0)


def _tied_held_once(net, state, prefix, metadata):
    """state_dict's hook: the tied embedder's tensors under block 0's names only, so that accelerate's
    safetensors save has no shared tensors to remove (and no warning to print)."""
    for tied in net._tied_blocks(prefix):
        for name in [name for name in state if name.startswith(tied)]:
            del state[name]


def _tied_filled_in(net, state, prefix, *args):
    """load_state_dict's hook: a tied block's embedder missing from `state` (held once, under block 0's
    names) is given block 0's tensors. A state with every block's (a saved network) loads as it is."""
    first = f"{prefix}transformer_blocks.0.norm1.emb."
    shared = {name[len(first):]: tensor for name, tensor in state.items() if name.startswith(first)}
    for tied in net._tied_blocks(prefix):
        for name, tensor in shared.items():
            state.setdefault(tied + name, tensor)


def build(size, patch, sample_size, in_channels=3, out_channels=None, num_classes=0):
    """A DiT-`size`/`patch` for inputs of `sample_size` (latents or pixels) with `in_channels` channels."""
    return DiT(num_classes=num_classes, sample_size=sample_size, in_channels=in_channels, out_channels=out_channels,
               **dit_kwargs(size, patch))  # fmt: skip


def trainable_parameters(net):
    return sum(p.numel() for p in net.parameters() if p.requires_grad)
