import time, torch, sys
sys.path.insert(0, ".")
import model as models, step as steps
from torch._dynamo.utils import counters
torch.manual_seed(0)
net = models.build_unet("dit-s2", 32, channels=4)
r = steps.compile_network(net, "default", scope="regional")
x = torch.randn(8, 4, 32, 32); t = torch.randint(0, 1000, (8,))
t0 = time.perf_counter()
out = r(x, t).sample
out.float().pow(2).mean().backward()
print("first", time.perf_counter() - t0)
print(dict(counters["stats"]))
t0 = time.perf_counter()
out = r(x, t).sample; out.float().pow(2).mean().backward()
print("second", time.perf_counter() - t0)
print(dict(counters["stats"]))
