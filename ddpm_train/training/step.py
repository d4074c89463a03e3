"""The training step: one optimizer step as one object, and the guard and loss meter it feeds.

    uint8 batch on the device -> flip, scale -> objective.terms(net, x0), summed -> backward
    -> clip -> AdamW (fused: skips a non-finite step on the device) -> LR schedule -> EMA

`TrainStep` does all of it with no host sync (unless --on_fault stop asks
for one), so train.py's loop and `python -m bench`'s rows call the very same code.
How it is compiled or captured on a GPU (`--compile_mode`) is compiling.py's.
"""

import contextlib
import functools
import math

import torch

from ddpm_train.data import captions
from ddpm_train.data import batches
from ddpm_train.diffusion import objectives
from ddpm_train.errors import RunError


class TrainStep:
    """One optimizer step: `step(micro_batches)` -> for each micro-batch, its loss and the loss's terms as device
    tensors: {"loss": the sum, and each term by its name}.

    `net` is what computes the network (the compiled one, or `model`);
    `model` is the module the optimizer holds, its parameters the ones the EMA
    follows. `objective.terms(net, x0)` draws its own noise on the device (objectives.Objective).
    With an `accelerator`, it accumulates gradients, scales fp16 losses and
    syncs DDP; without one (`python -m bench`), `autocast` gives the precision.
    `mark(phase)` is called at each phase boundary (train.py's Breakdown).

    A micro-batch is a uint8 image tensor, or (images, labels) for a
    class-conditional or captioned run (its labels captions.Words): each label is replaced by `null_label` with
    probability `label_dropout` (drawn on the device), so that the network
    learns the unconditional model classifier-free guidance needs beside the
    conditional one (Ho & Salimans 2022).
    """

    def __init__(self, net, model, objective, optimizer, lr_scheduler, ema, guard, max_grad_norm, random_flip,
                 accelerator=None, autocast=contextlib.nullcontext, mark=None, label_dropout=0.0, null_label=None):  # fmt: skip
        self.net, self.model, self.objective = net, model, objective
        self.optimizer, self.lr_scheduler, self.ema, self.guard = optimizer, lr_scheduler, ema, guard
        self.max_grad_norm = max_grad_norm or math.inf
        self.random_flip = random_flip
        self.accelerator, self.autocast = accelerator, autocast
        self.mark = mark or (lambda phase: None)
        self.label_dropout, self.null_label = label_dropout, null_label
        self.trained = [p for group in optimizer.param_groups for p in group["params"]]  # network and objective

    def __call__(self, micro_batches, step_number=None):
        losses = self.descend(micro_batches, step_number)
        self.lr_scheduler.step()
        if self.ema is not None:  # without one, "where the time went" shows no ema part
            self.ema.step(self.model.parameters())
            self.mark("ema")
        return losses

    def descend(self, micro_batches, step_number=None):
        """Forward, backward, clipping, the non-finite guard and the optimizer, for every micro-batch."""
        losses = []
        for batch in micro_batches:
            images, labels = batch if isinstance(batch, (tuple, list)) else (batch, None)
            with self._accumulate():
                x0 = batches.to_model_input(images, self.random_flip)
                net = self.net if labels is None else functools.partial(self.net, class_labels=self.drop_labels(labels))
                with self.autocast():
                    terms = self.objective.terms(net, x0)
                    loss = objectives.total_loss(terms)
                self.mark("forward")
                self._backward(loss)
                self.mark("backward")
                if self._sync_gradients():
                    self._average_objective_gradients()
                    grad_norm = self._clip()
                    if self.guard is not None:
                        self.guard.check(loss, grad_norm, step_number)
                self.optimizer.step()  # accelerate's wrapper steps only when gradients are synced
                self.optimizer.zero_grad(set_to_none=True)
            losses.append({"loss": loss.detach()} | {name: term.detach() for name, term in terms.items()})
            self.mark("optimizer")
        return losses

    def drop_labels(self, labels):
        """`labels` with each replaced by the null label with probability label_dropout. A captioned run's labels are
        its batch's captions (captions.Words), its null label the empty caption's."""
        if not self.label_dropout:
            return labels
        words = isinstance(labels, captions.Words)
        rows = labels.mask if words else labels
        dropped = torch.rand(len(rows), device=rows.device) < self.label_dropout
        if words:
            return labels.where(dropped, self.null_label)
        return torch.where(dropped, torch.full_like(labels, self.null_label), labels)

    def _accumulate(self):
        return self.accelerator.accumulate(self.model) if self.accelerator else contextlib.nullcontext()

    def _backward(self, loss):
        if self.accelerator:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def _sync_gradients(self):
        return self.accelerator.sync_gradients if self.accelerator else True

    def _average_objective_gradients(self):
        """The objective's own parameters (EDM's u(sigma)) sit outside the DDP wrapper: average them here."""
        if self.accelerator and self.accelerator.num_processes > 1:
            for p in self.objective.parameters():
                if p.grad is not None:
                    p.grad = self.accelerator.reduce(p.grad, reduction="mean")

    def _clip(self):
        clip = self.accelerator.clip_grad_norm_ if self.accelerator else torch.nn.utils.clip_grad_norm_
        return clip(self.trained, self.max_grad_norm)


# --- the guard and the loss meter the step feeds --------------------------------------


class LossMeter:
    """The mean loss and the mean of each of its terms over a log interval, kept on the device so that adding
    costs no host sync.

    A step whose loss is not finite (a step NonFiniteGuard skips) is left out of every mean.
    """

    def __init__(self, device):
        self.device = device
        self.sums, self.count = {}, torch.zeros((), device=device)
        self.last = float("nan")  # the mean loss of the last interval that had a finite one
        self.last_terms = {}  # and the means of its terms, by name

    def add(self, losses):
        """Adds one micro-batch's {"loss": ..., term name: ...} (TrainStep's)."""
        finite = torch.isfinite(losses["loss"].detach())
        for name, value in losses.items():
            total = self.sums.setdefault(name, torch.zeros((), device=self.device))
            total += torch.where(finite, value.detach(), 0.0)
        self.count += finite

    def read(self):
        """Sets `last` and `last_terms` to the interval's means and starts a new interval; False if it had no
        finite loss."""
        count = self.count.item()
        if count:
            means = dict(zip(self.sums, (torch.stack(list(self.sums.values())) / count).tolist()))
            self.last = means.pop("loss")
            self.last_terms = means
            for total in self.sums.values():
                total.zero_()
            self.count.zero_()
        return bool(count)


class NonFiniteGuard:
    """Keeps a step whose loss or gradients are NaN/inf from changing the weights.

    A fused AdamW takes the decision on the device: given `found_inf` (the
    hook torch's GradScaler uses) it leaves weights, moments and step count
    as they were, so 'skip' costs no host sync. Otherwise, and for 'stop',
    the flag is read on the host every step.
    """

    def __init__(self, optimizer, mode, device):
        self.inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        self.mode = mode
        self.on_device = mode == "skip" and bool(self.inner.defaults.get("fused"))
        self.skipped = torch.zeros((), device=device)

    def check(self, loss, grad_norm, step):
        bad = ~(torch.isfinite(grad_norm) & torch.isfinite(loss.detach()))
        self.skipped += bad
        if self.on_device:
            self.inner.found_inf = bad.float()
            return
        if bad.item():
            if self.mode == "stop":
                raise RunError(
                    f"non-finite loss or gradient at step {step} (--on_fault stop): lower --learning_rate "
                    "or use --on_fault skip; the last checkpoint holds the state before it"
                )
            for group in self.inner.param_groups:  # without a fused optimizer, drop the gradients
                for p in group["params"]:
                    p.grad = None

    def count(self):
        return int(self.skipped.item())
