"""sample.py with guidance limited to an interval of noise levels (Kynkaanniemi et al. 2024), for a flow run:
the network's t = 1000 sigma (flow's sigma); outside (LO, HI] the conditional output alone (w = 1).
EDM2's ImageNet-512 interval sigma_EDM in (0.28, 5.42] is flow sigma in (0.219, 0.844].

    python interval_sample.py LO HI RUN [sample.py flags...]
"""
import sys

import torch

sys.path.insert(0, "/work/wt-lab")
import sample  # noqa: E402

lo, hi = float(sys.argv[1]) * 1000, float(sys.argv[2]) * 1000
plain = sample.Guided.forward


def forward(self, x, t, return_dict=False):
    if self.scale == 1 or self.labels is None or self.guide is not None:
        return plain(self, x, t, return_dict)
    inside = (torch.as_tensor(t) > lo) & (torch.as_tensor(t) <= hi)
    if bool(inside.all()):
        return plain(self, x, t, return_dict)
    if not bool(inside.any()):
        return (self._call(self.net, x, t, self.labels),)
    guided, cond = plain(self, x, t, return_dict)[0], self._call(self.net, x, t, self.labels)
    mask = inside.float().reshape(-1, *([1] * (x.ndim - 1)))
    return (cond + mask * (guided - cond),)


sample.Guided.forward = forward
sample.main(sample.parse_args(sys.argv[3:]))
