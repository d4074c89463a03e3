"""What keying FID's reference statistics by the dataset's contents costs at a run's start: opening a folder of
N files (the listing) and data.dataset_identity (a stat of each), twice each (the second with the listing cached).

    python contents_cost.py REPO FOLDER      # FOLDER: e.g. 100 folders of 1,000 one-byte .png files
"""

import argparse
import sys
import time

sys.path.insert(0, sys.argv[1])
import data  # noqa: E402
import metrics  # noqa: E402

options = dict(dataset=sys.argv[2], dataset_config=None, split="train", image_column=None, augment="none")
for _ in range(2):
    start = time.perf_counter()
    dataset = metrics.reference_images(options, 32)
    opened = time.perf_counter()
    identity = data.dataset_identity(argparse.Namespace(**options), dataset)
    print(f"{identity['files']} files: opened in {opened - start:.2f} s, identity in {time.perf_counter() - opened:.2f} s")
