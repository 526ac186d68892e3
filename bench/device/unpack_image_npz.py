"""Write the image folders back from the one-file image set bench/device/stage_gpu_reference.sh packs (a call counts thousands
of small files for far more than their bytes): PNG bytes + offsets + labels + names + class names in one .npz.
    python3 bench/device/unpack_image_npz.py .devgr/cifar-test.npz /tmp/dd/cifar-test [--per-class 100]
--per-class N: only the first N images of each class (in the packed order: sorted file names)."""
import argparse
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("dest")
    ap.add_argument("--per-class", type=int, default=None)
    a = ap.parse_args()
    d = np.load(a.npz)
    buf, off, seen = d["data"].tobytes(), d["off"], {}
    for i, (y, name) in enumerate(zip(d["y"], d["names"])):
        if a.per_class is not None and seen.get(int(y), 0) >= a.per_class:
            continue
        seen[int(y)] = seen.get(int(y), 0) + 1
        folder = os.path.join(a.dest, str(d["classes"][y]))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, str(name)), "wb") as f:
            f.write(buf[off[i]:off[i + 1]])
    print(f"{a.dest}: {sum(seen.values())} images")


if __name__ == "__main__":
    main()
