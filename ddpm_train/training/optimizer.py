"""The optimizer a run trains with: AdamW, or Muon for the blocks' matrices and AdamW for the rest.

`build(args.optimizer, network, ...)` makes it. --optimizer adamw is torch's AdamW over every parameter.
--optimizer muon is torch.optim.Muon for the 2-D weights of the network's repeated blocks
(models.block_names: a DiT's transformer blocks, a UNet's ResNet and attention blocks, EDM2's blocks),
except those of an embedder a block holds (a DiT's norm1.emb, one module that every block shares). AdamW,
built as for --optimizer adamw, takes the rest: embeddings, norms, biases, gains, the layers before and after
the blocks (a DiT's patch projection, proj_out_1 and proj_out_2), every conv kernel, and the objective's
parameters (EDM's learned loss weighting). One MuonAdamW holds the two, and accelerate, the LR schedule, fp16's
scaler, step.NonFiniteGuard and the checkpoints see only it.

Muon scales each matrix's update by 0.2 * sqrt(max(rows, columns)) (adjust_lr_fn "match_rms_adamw", Liu et
al. 2025), so that its RMS matches AdamW's and --learning_rate and --weight_decay carry over; its momentum is
torch's default, 0.95 with Nesterov (--adam_betas are AdamW's). A fused matrix, whose rows are the outputs of
several maps (a DiT block's adaLN modulation: shift, scale and gate for the attention and for the MLP, six
blocks of rows), is orthogonalized one block of rows at a time, as CMuon (2026) splits fused matrices
(SplitMuon).

On a CPU, Newton-Schulz runs in float32: torch's runs it in bf16, which a CPU without bf16 units multiplies
some 30x slower than float32 (a `dit-small` step took 30 s instead of under one).

Conv kernels (4-D) go to AdamW. torch's Muon takes 2-D parameters only, and the (out, in * k * k) matrix of a
channels_last kernel (the layout a UNet trains in on a GPU) is a copy, not a view of the weight: Muon on kernels
would need a step of its own that writes each update back. A UNet's Muon therefore trains its attention
projections and its ResNet blocks' time projections alone (docs/muon.md).
"""

import inspect
import warnings
from typing import Callable, NamedTuple

import torch
from torch.optim import _muon

from ddpm_train.networks import model as models

# The modules whose `linear` weight is several matrices stacked by rows, by class name, and how many: diffusers'
# AdaLayerNormZero (a DiT block's norm1), whose output is cut into shift, scale and gate for attention and the MLP.
FUSED = {"AdaLayerNormZero": 6}


def build(kind, network, fused=False, also=(), foreach=True, **adamw):
    """The optimizer of `network`'s parameters and `also` (more to train: EDM's learned loss weighting) for
    --optimizer `kind` (OPTIMIZERS): torch's AdamW ("adamw"), or a MuonAdamW ("muon": Muon for
    muon_matrices(network) at `adamw`'s lr and weight_decay, AdamW for the rest).

    AdamW is fused (one kernel reads each parameter, gradient and moment once per step) when `fused` and torch
    has the kernel for the device, else foreach (a few multi-tensor kernels); never the per-parameter loop,
    unless `foreach` is None: then torch picks, as diffusers' example builds its AdamW (the speed ladder's
    yardstick). `adamw`: lr, betas, weight_decay, eps.
    """
    return OPTIMIZERS[kind].build(network, list(network.parameters()) + list(also), fused, foreach, adamw)


def _build_adamw(network, parameters, fused, foreach, adamw):
    return _adamw(parameters, fused, foreach, adamw)


def _build_muon(network, parameters, fused, foreach, adamw):
    matrices = muon_matrices(network)
    taken = {id(p) for group in matrices.values() for p in group}
    muon = SplitMuon([{"params": group, "chunks": chunks} for chunks, group in matrices.items()], lr=adamw["lr"],
                     weight_decay=adamw["weight_decay"], adjust_lr_fn="match_rms_adamw")  # fmt: skip
    return MuonAdamW(muon, _adamw([p for p in parameters if id(p) not in taken], fused, foreach, adamw))


def state_bytes(optimizer):
    """Bytes the optimizer's state will hold once its first step has made it: AdamW's two moments per trained
    parameter (three with amsgrad), Muon's one momentum buffer per matrix (a MuonAdamW holds both), each of its
    parameter's dtype; None for an optimizer of another kind. The per-parameter step counts are left out."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    if isinstance(inner, MuonAdamW):
        return state_bytes(inner.muon) + state_bytes(inner.adamw)
    if isinstance(inner, torch.optim.Muon):
        buffers = lambda group: 1  # noqa: E731
    elif isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        buffers = lambda group: 3 if group.get("amsgrad") else 2  # noqa: E731
    else:
        return None
    return sum(buffers(g) * sum(p.numel() * p.element_size() for p in g["params"] if p.requires_grad) for g in inner.param_groups)


def _adamw(parameters, fused, foreach, settings):
    if fused and fused_adamw_available(parameters):
        return torch.optim.AdamW(parameters, fused=True, **settings)
    return torch.optim.AdamW(parameters, foreach=foreach, **settings)


def fused_adamw_available(parameters):
    """Whether torch has a fused AdamW kernel for every parameter's device and dtype."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and p.is_floating_point() for p in parameters)


def muon_matrices(network):
    """{blocks of rows: [weights]}: the 2-D weights of `network`'s repeated blocks that Muon trains, in the
    network's order, each under the number of blocks of rows it is orthogonalized in (1: whole; FUSED's for a
    fused matrix). An embedder's weights (a module whose class name says Embedding) are left to AdamW."""
    modules = dict(network.named_modules())
    blocks = [modules[name] for name in models.block_names(network)]
    embedders = {id(p) for block in blocks for m in block.modules() if "Embedding" in type(m).__name__ for p in m.parameters()}
    chunks = {id(m.linear.weight): FUSED[type(m).__name__] for m in network.modules() if type(m).__name__ in FUSED}
    found, seen = {}, set(embedders)
    for p in (p for block in blocks for p in block.parameters()):
        if p.ndim == 2 and id(p) not in seen:
            seen.add(id(p))
            found.setdefault(chunks.get(id(p), 1), []).append(p)
    return found


class SplitMuon(torch.optim.Muon):
    """torch's Muon, where a param group's "chunks" n > 1 takes each of its matrices as n blocks of rows, each
    orthogonalized, and its learning rate matched to its shape, as a matrix of its own. The blocks are views: the
    update lands in the matrix, and its momentum in the one buffer the matrix keeps (so its state dict is torch's)."""

    def step(self, closure=None):
        """torch's step; on a CPU with Newton-Schulz in float32 (newton_schulz_fp32) for the step's length, where
        torch's private function still takes its arguments (fp32_fits)."""
        if self.param_groups[0]["params"][0].device.type != "cpu" or not fp32_fits():
            return super().step(closure)
        in_bf16, _muon._zeropower_via_newtonschulz = _muon._zeropower_via_newtonschulz, newton_schulz_fp32
        try:
            return super().step(closure)
        finally:
            _muon._zeropower_via_newtonschulz = in_bf16

    def _init_group(self, group, params, grads, buffers):  # torch's: the tensors of `group` a step updates
        has_complex = super()._init_group(group, params, grads, buffers)
        if group.get("chunks", 1) > 1:
            for tensors in (params, grads, buffers):
                tensors[:] = [block for tensor in tensors for block in tensor.chunk(group["chunks"])]
        return has_complex


_FITS = {}  # torch's _zeropower_via_newtonschulz -> whether newton_schulz_fp32 takes its place


def fp32_fits():
    """Whether torch's private _zeropower_via_newtonschulz takes newton_schulz_fp32's arguments (its signature differs
    in torch's main branch). Where not, torch's own (bf16) runs, said once in a warning, not a TypeError at a step."""
    torch_s = _muon._zeropower_via_newtonschulz
    if torch_s not in _FITS:
        _FITS[torch_s] = inspect.signature(torch_s).parameters.keys() == inspect.signature(newton_schulz_fp32).parameters.keys()
        if not _FITS[torch_s]:
            warnings.warn(f"--optimizer muon: this torch's Newton-Schulz takes {inspect.signature(torch_s)}, not "
                          "(grad, ns_coefficients, ns_steps, eps): on a CPU it runs in torch's bf16, slower")  # fmt: skip
    return _FITS[torch_s]


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's _zeropower_via_newtonschulz (KellerJordan/Muon's quintic iteration) in float32, not bf16."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """A Muon and an AdamW as one optimizer. Its param_groups are the two's own group dicts, Muon's first, so
    that whatever sets a group's "lr" (the LR schedule) or walks its parameters (gradient clipping, fp16's scaler,
    step.NonFiniteGuard) reaches both; its state_dict holds the two's. Its `defaults` name no "fused": the
    non-finite guard drops a bad step's gradients on the host (one sync a step), as for an AdamW not fused."""

    def __init__(self, muon, adamw):
        # Optimizer.__init__ would hold groups and state of its own: the two hold them (as accelerate's wrapper)
        self.muon, self.adamw, self.defaults = muon, adamw, {}

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups  # read afresh: load_state_dict makes new dicts

    @property
    def state(self):
        return self.muon.state | self.adamw.state

    def step(self, closure=None):
        loss = self.muon.step(closure)
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict):
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


class Kind(NamedTuple):
    """What the rest of the code asks of an --optimizer."""

    build: Callable  # (network, parameters, fused, foreach, adamw settings) -> the optimizer
    host_reads: str = ""  # what its step reads on the host, which a captured step graph cannot hold ("": none)


OPTIMIZERS = {
    "adamw": Kind(_build_adamw),
    "muon": Kind(_build_muon, "the non-finite guard and Muon's learning rate are read on the host"),
}
