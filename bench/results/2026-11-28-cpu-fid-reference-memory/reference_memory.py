"""Peak host memory of FID's reference statistics over N images, with a stand-in extractor of Inception's
2048 features (a random projection: the statistics' memory, not Inception's time, is what is measured).

    python reference_memory.py REPO N      # REPO: a checkout of this project (before or after the change)

Prints the process's peak RSS before and after the reference is made, and the seconds it took."""

import resource
import sys
import tempfile
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

import metrics  # noqa: E402


class Features(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("projection", torch.randn(3, 2048, generator=torch.Generator().manual_seed(0)))

    def forward(self, images):
        return torch.tanh(images.float().mean((2, 3)) / 255 @ self.projection)


n = int(sys.argv[2])
images = torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
start = time.perf_counter()
with tempfile.TemporaryDirectory() as folder:
    reference = metrics.cached_reference(folder, {"dataset": "bench"}, lambda: images, Features(), "cpu", 256, log=lambda _: None)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
print(f"{n} images: peak RSS {before:.0f} MiB before, {peak:.0f} MiB after ({peak - before:+.0f} MiB), {seconds:.1f} s, "
      f"{reference.num_images} images in the statistics, KID subset {tuple(reference.kid_features.shape)}")
