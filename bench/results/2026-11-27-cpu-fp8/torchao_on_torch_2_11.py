import torch, torchao, warnings
print("torch", torch.__version__, "torchao", torchao.__version__)
from torchao.float8 import convert_to_float8_training, Float8LinearConfig
m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)); ref.load_state_dict(m.state_dict())
convert_to_float8_training(m, config=Float8LinearConfig())
print([type(x).__name__ for x in m])
x = torch.randn(32, 64)
with torch.autocast("cpu", torch.bfloat16):
    y = m(x); r = ref(x)
y.float().square().mean().backward()
print("rel diff vs bf16", ((y.float() - r.float()).norm() / r.float().norm()).item(), "grad", m[0].weight.grad.shape)
c = torch.compile(m)
with torch.autocast("cpu", torch.bfloat16):
    yc = c(x)
yc.float().square().mean().backward()
print("compiled ok", ((yc.float() - y.float()).norm() / y.float().norm()).item())
