# Does Inductor fuse DiT's adaLN modulate (norm(x) * (1 + scale) + shift) with the LayerNorm? A DiT-S/2 block, CPU.
import sys, re, torch
sys.path.insert(0, "/work/main")
import model as models
from torch._inductor.utils import run_and_get_code
net = models.build_unet("dit-s2", 32, channels=4)
block = net.transformer_blocks[0]
x = torch.randn(2, 256, 384); emb = net.transformer_blocks[0].norm1.emb
t = torch.full((2,), 500); y = torch.zeros(2, dtype=torch.long)
def norm_modulate(x, t, y):
    normed, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(x, t, y, hidden_dtype=x.dtype)
    return normed
out, codes = run_and_get_code(torch.compile(norm_modulate), x, t, y)
code = codes[0]
kernels = re.findall(r"cpp_fused_[\w]+", code)
print("kernels:", sorted(set(kernels)))
for k in sorted(set(kernels)):
    body = code.split(f"{k} = async_compile.cpp_pybinding")[1].split("async_compile")[0] if f"{k} = async_compile" in code else ""
    print(k, "has rsqrt/var:", "rsqrt" in body or "welford" in body.lower(), "len", len(body))
