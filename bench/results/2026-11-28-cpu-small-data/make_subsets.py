"""The 16- and 200-image sets of part A: the first files of /tmp/sd/lab/train's classes, taken
round-robin over the sorted classes (16: two each of the first six classes, one of the last four;
200: twenty of each), copied into flat folders /tmp/sd/flat16 and /tmp/sd/flat200."""
import os
import shutil

root = "/tmp/sd/lab/train"
classes = sorted(os.listdir(root))
files = {c: sorted(os.listdir(f"{root}/{c}")) for c in classes}
for n in (16, 200):
    out = f"/tmp/sd/flat{n}"
    os.makedirs(out, exist_ok=True)
    k = i = 0
    while k < n:
        for c in classes:
            if k == n:
                break
            shutil.copy(f"{root}/{c}/{files[c][i]}", f"{out}/{c}_{files[c][i]}")
            k += 1
        i += 1
    print(n, len(os.listdir(out)))
