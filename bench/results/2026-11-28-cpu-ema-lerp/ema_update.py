"""diffusers' EMAModel foreach update against ema.LerpEMA's on DiT-XL/2's parameters (fp32), on this CPU."""
import statistics, sys, time, torch
import model as models, ema
from diffusers.training_utils import EMAModel
torch.set_num_threads(2)
net = models.build_unet("dit-xl2", 32, channels=4)
params = list(net.parameters())
print(f"{sum(p.numel() for p in params):,} parameters in {len(params)} tensors, torch {torch.__version__}")
settings = dict(decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75, foreach=True)
kinds = dict(diffusers=EMAModel(params, **settings), lerp=ema.LerpEMA(params, **settings))
times = {k: [] for k in kinds}
for rep in range(9):
    for name, e in kinds.items():
        start = time.perf_counter(); e.step(params); times[name].append(time.perf_counter() - start)
for name, t in times.items():
    print(f"{name}: median {statistics.median(t[1:]) * 1e3:.0f} ms over {len(t) - 1} steps (first {t[0] * 1e3:.0f} ms): {[round(x * 1e3) for x in t]}")
print(f"ratio diffusers/lerp {statistics.median(times['diffusers'][1:]) / statistics.median(times['lerp'][1:]):.2f}")
