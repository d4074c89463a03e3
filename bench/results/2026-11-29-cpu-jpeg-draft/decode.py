"""Decodes every image of FOLDER as a run at SIZE does (data.open_dataset's FileImages: read, turned, resized to
cover, cropped) and prints the seconds it took; with --whole, each JPEG decoded at its full size (no draft), as
before 2026-11-29."""

import sys
import time

sys.path.insert(0, ".")
import data  # noqa: E402

folder, size, whole = sys.argv[1], int(sys.argv[2]), "--whole" in sys.argv
images = data.open_dataset(folder, size)
if whole:
    images.box = None
start = time.perf_counter()
for i in range(len(images)):
    image, error = images[i]
    assert error is None, error
print(f"{len(images)} images at {size}{' whole' if whole else ''}: {time.perf_counter() - start:.2f} s, {tuple(image.shape)}")
