"""Random numbers keyed by (seed, epoch, index): each image's draw depends on those alone, not on the batch it
lands in, the number of processes or where a run resumed, and a whole batch is drawn in a few vectorised int64 ops.
The latent cache draws each epoch's orientation and posterior noise with them, the captions each image's caption.
"""

import math

import torch


# A counter-based generator: splitmix64 (Steele, Lea and Flood 2014) on int64 tensors, whose arithmetic wraps
# modulo 2^64 as unsigned arithmetic does, with shifts made logical. Each image's words are a splitmix64 stream
# seeded by its key, itself the element `index` of a stream seeded by (seed, epoch): a draw depends on (seed,
# epoch, index) alone, and a whole batch is drawn in a few vectorised integer ops.
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = 2**64 - 1


def signed(x):
    x &= _MASK
    return x - 2**64 if x >= 2**63 else x


def shr(x, s):
    """Logical right shift of an int64 tensor (torch's >> is arithmetic)."""
    shifted = x >> s
    return shifted.bitwise_and_((1 << (64 - s)) - 1)


def mix(x):
    """splitmix64's finaliser, elementwise on an int64 tensor (the bits of the uint64); x is not changed."""
    x = x ^ shr(x, 30)
    x.mul_(signed(_MIX1))
    x.bitwise_xor_(shr(x, 27)).mul_(signed(_MIX2))
    return x.bitwise_xor_(shr(x, 31))


def mix_int(x):
    """mix on a Python int, in exact uint64 arithmetic: the reference the tensor version is tested against."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK
    return x ^ (x >> 31)


def draw_keys(seed, epoch, indices):
    """(B,) int64: each image's key, a function of (seed, epoch, index) alone."""
    base = mix_int(mix_int(int(seed) + _GOLDEN) + int(epoch) * _GOLDEN)
    return mix(torch.as_tensor(indices, dtype=torch.int64) * signed(_GOLDEN) + signed(base))


def words(keys, count):
    """(B, count) int64 random words: words 0, 1, ... of each key's stream."""
    counter = torch.arange(1, count + 1, dtype=torch.int64) * signed(_GOLDEN)
    return mix(keys[:, None] + counter)


def normals(words, count):
    """(B, count) float32 standard normals from (B, ceil(count / 2)) words: Box-Muller on two 24-bit uniforms
    of each word (float32 holds them exactly): bits 40-63 in (0, 1] give the radius, bits 8-31 the angle. The
    radius tops out at sqrt(2 ln 2^24) = 5.77: a draw beyond 5.77 sigma (p = 8e-9) is left out."""
    high = shr(words, 40).add_(1).float().mul_(2.0**-24)
    low = shr(words, 8).bitwise_and_(0xFFFFFF).float().mul_(2 * math.pi * 2.0**-24)
    radius = high.log_().mul_(-2).sqrt_()
    return torch.cat([low.cos().mul_(radius), low.sin_().mul_(radius)], 1)[:, :count]
