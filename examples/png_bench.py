"""Our PNG writer (media/encode.py: Up filter, deflate in pieces on threads) against PIL's at the same zlib level, on
one 1024x1024 RGB image with a photo's smooth gradients plus noise; median of --runs, in one process.

    python examples/png_bench.py --runs 5
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minisgl_cli.media import encode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", type=int, default=1024)
    a = ap.parse_args()
    y, x = np.mgrid[0:a.size, 0:a.size]
    smooth = np.stack([(x + y) // 8 % 256, (x * y) // a.size % 256, np.sin(x / 40) * 120 + 128], -1)
    noise = np.random.default_rng(0).integers(0, 8, smooth.shape)
    image = Image.fromarray((smooth.astype(int) + noise).clip(0, 255).astype(np.uint8))

    def pil() -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG", compress_level=encode.PNG_LEVEL)
        return buf.getvalue()

    for name, write in (("PIL", pil), ("ours", lambda: encode.png_bytes(image))):
        times, size = [], 0
        for _ in range(a.runs):
            t = time.perf_counter()
            size = len(write())
            times.append(time.perf_counter() - t)
        print(f"{name:5s} {1e3 * statistics.median(times):7.1f} ms  {size:,} bytes  "
              f"({encode.PNG_THREADS} threads for ours, zlib level {encode.PNG_LEVEL})")


if __name__ == "__main__":
    main()
