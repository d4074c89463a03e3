"""FP8 training of a transformer's linear layers: `--mixed_precision fp8` (docs/fp8.md).

torchao's float8 training (`Float8Linear`, dynamic tensorwise scaling: e4m3 forward, e5m2
gradients) replaces the linear layers of each transformer block, attention's q, k, v and
output projections and the MLP, through accelerate's `convert_model_to_fp8_ao` with
this module's filter. The patch embedding, the timestep and label embedders, the adaLN
modulation and the final layer stay in bf16, as torchtitan's filter keeps its embeddings
and output; everything else runs under bf16 autocast, as accelerate's own fp8 mode does.

The conversion is made in builder.build, which train.py and the speed ladder share, not
in accelerate's `prepare` (accelerate's fp8 mode converts there, which the ladder never
calls, and on a GPU without FP8 tensor cores it trains fp16 instead with a warning: here
that GPU is refused). `Float8Linear` keeps the layer's own weight and bias, so the
optimizer, checkpoints and the EMA see ordinary fp32 tensors under their usual names;
`plain` turns a copy back into `nn.Linear` for sampling and saving, so that a saved
network loads in diffusers like any other.

On a CPU `torch._scaled_mm` runs, emulated: for tests, never faster than bf16.
"""

import torch

from ddpm_train.networks import model as models

# FP8 tensor cores: Ada (8.9), Hopper (9.0) and later.
MIN_CAPABILITY = (8, 9)
# torchao 0.18.0 (requirements.txt) supports torch 2.11 and later (its __init__'s min_torch_version).
TORCHAO_VERSION = "0.18.0"
MIN_TORCH = (2, 11)
# torch._scaled_mm takes dimensions that are multiples of 16: a smaller or odd layer stays in bf16.
MULTIPLE = 16
# The layers of a block that train in FP8: attention's projections and the MLP (diffusers' names).
CONVERTED = ("attn1.", "attn2.", "ff.")


def torch_version(text=None):
    """(major, minor) of torch's version string."""
    major, minor = (text or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def refusal(args, device):
    """Why this run cannot train in FP8 (None: it can), in one line that says what to change."""
    if not models.family(args.model)[0].transformer:
        return (f"--mixed_precision fp8 trains a transformer's linear layers in FP8, and {args.model} has none to "
                "convert (a network of convolutions): use bf16, or a dit-* preset")  # fmt: skip
    if torch_version() < MIN_TORCH:
        return (f"--mixed_precision fp8 needs torch {'.'.join(map(str, MIN_TORCH))} or later for torchao "
                f"{TORCHAO_VERSION}; this is torch {torch.__version__}: upgrade torch, or use bf16")  # fmt: skip
    try:
        _torchao_float8()
    except ImportError:
        return f"--mixed_precision fp8 needs torchao: pip install torchao=={TORCHAO_VERSION} (requirements.txt), or use bf16"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            return (f"--mixed_precision fp8 needs FP8 tensor cores (compute capability 8.9 or above: Ada, Hopper or "
                    f"later); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use bf16")  # fmt: skip
    return None


def _torchao_float8():
    """torchao.float8 (imported when a run asks for fp8: an ImportError says it is not installed)."""
    import torchao.float8

    return torchao.float8


def convertible(module, name):
    """accelerate's module_filter_func: a linear layer of a transformer block's attention or MLP, both of its
    dimensions multiples of 16. The adaLN modulation and the embedders (a block's norm1) are not."""
    if not isinstance(module, torch.nn.Linear) or module.in_features % MULTIPLE or module.out_features % MULTIPLE:
        return False
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "transformer_blocks" and ".".join(parts[2:]).startswith(CONVERTED)


def convert(network):
    """Swap the convertible linear layers of `network` for torchao's Float8Linear, in place (their weights
    and biases are the same tensors); returns how many were swapped."""
    from accelerate.utils.ao import convert_model_to_fp8_ao

    float8 = _torchao_float8()
    convert_model_to_fp8_ao(network, config=float8.Float8LinearConfig(), module_filter_func=convertible)
    return count(network)


def count(network):
    """How many of `network`'s layers train in FP8."""
    return sum(1 for m in network.modules() if _is_float8(m))


def describe(network, device):
    """The first line's words for an fp8 run."""
    where = ("; emulated on a CPU: for tests, not faster than bf16" if device.type != "cuda" else
             "; time it against bf16: at DiT-XL/2's width an H100 ran no faster in FP8, in less memory (docs/fp8.md)")
    return f" ({count(network)} linear layers in FP8 through torchao, the rest bf16{where})"


def _is_float8(module):
    return type(module).__name__ == "Float8Linear"


def plain(network):
    """`network` with each Float8Linear replaced by an nn.Linear holding the same weight and bias, in place:
    a copy for sampling and saving computes in the autocast's precision and loads anywhere."""
    for parent in list(network.modules()):
        for name, child in list(parent.named_children()):
            if _is_float8(child):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(parent, name, linear)
    return network
