#!/usr/bin/env python3
"""Writes ImageNet-sized JPEGs in ImageFolder layout for the input-pipeline benchmarks (nothing is committed).

    python3 scripts/gen-jpegs.py --out /tmp/jpegs --count 3072 [--val-count 256] [--classes 8]
        [--width 500] [--height 375] [--quality 90] [--seed 0] [--jobs N]

Layout: OUT/train/class_XX/img_NNNNNN.JPEG (and OUT/val/... with --val-count). Each image is a random mix of a
colour gradient, shapes, a sinusoidal texture and sensor-like noise, tuned so that 500x375 at quality 90 weighs
about 85 KB, like an average ImageNet photo. Content depends on (seed, split, index) only.

Encoders, first found: PIL (Pillow), torchvision.io.encode_jpeg. Pixels come from numpy, or torch when numpy is
missing. With neither encoder it exits with a message saying what to install.
"""

import argparse
import math
import os
import random
import sys

try:
    import numpy as np
except ImportError:  # torch below generates the pixels instead
    np = None

try:
    from PIL import Image
except ImportError:
    Image = None


def torch_modules():
    try:
        import torch
        import torchvision.io

        return torch, torchvision.io
    except ImportError:
        return None, None


def pixels_numpy(rng, w, h):
    """(h, w, 3) uint8 with numpy."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    a = rng.uniform(0, 2 * math.pi)
    t = (xx * math.cos(a) + yy * math.sin(a)) / max(w, h)
    c0 = np.array([rng.uniform(0, 255) for _ in range(3)], np.float32)
    c1 = np.array([rng.uniform(0, 255) for _ in range(3)], np.float32)
    img = c0 + (c1 - c0) * ((t - t.min()) / max(float(t.max() - t.min()), 1e-6))[..., None]
    for _ in range(rng.randint(3, 9)):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        rx, ry = rng.uniform(0.05, 0.35) * w, rng.uniform(0.05, 0.35) * h
        col = np.array([rng.uniform(0, 255) for _ in range(3)], np.float32)
        if rng.random() < 0.5:
            m = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1.0
        else:
            m = (abs(xx - cx) <= rx) & (abs(yy - cy) <= ry)
        img[m] = 0.35 * img[m] + 0.65 * col
    fx, fy = rng.uniform(0.02, 0.25), rng.uniform(0.02, 0.25)
    tex = np.sin(xx * fx + rng.uniform(0, 6)) * np.sin(yy * fy + rng.uniform(0, 6))
    img += (rng.uniform(10, 35) * tex)[..., None]
    nrng = np.random.default_rng(rng.getrandbits(63))
    img += nrng.normal(0.0, rng.uniform(12.0, 19.0), size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def pixels_torch(torch, rng, w, h):
    """(3, h, w) uint8 tensor with torch (no numpy)."""
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    yy = torch.arange(h, dtype=torch.float32)[:, None].expand(h, w)
    xx = torch.arange(w, dtype=torch.float32)[None, :].expand(h, w)
    a = rng.uniform(0, 2 * math.pi)
    t = (xx * math.cos(a) + yy * math.sin(a)) / max(w, h)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    c0 = torch.tensor([rng.uniform(0, 255) for _ in range(3)])[:, None, None]
    c1 = torch.tensor([rng.uniform(0, 255) for _ in range(3)])[:, None, None]
    img = c0 + (c1 - c0) * t[None]
    for _ in range(rng.randint(3, 9)):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        rx, ry = rng.uniform(0.05, 0.35) * w, rng.uniform(0.05, 0.35) * h
        col = torch.tensor([rng.uniform(0, 255) for _ in range(3)])[:, None, None]
        if rng.random() < 0.5:
            m = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1.0
        else:
            m = ((xx - cx).abs() <= rx) & ((yy - cy).abs() <= ry)
        img = torch.where(m[None], 0.35 * img + 0.65 * col, img)
    fx, fy = rng.uniform(0.02, 0.25), rng.uniform(0.02, 0.25)
    tex = torch.sin(xx * fx + rng.uniform(0, 6)) * torch.sin(yy * fy + rng.uniform(0, 6))
    img = img + rng.uniform(10, 35) * tex[None]
    img = img + torch.randn(img.shape, generator=g) * rng.uniform(12.0, 19.0)
    return img.clamp(0, 255).to(torch.uint8)


def write_one(job):
    path, seed, w, h, quality = job
    rng = random.Random(seed)
    if Image is not None:
        if np is not None:
            Image.fromarray(pixels_numpy(rng, w, h), "RGB").save(path, "JPEG", quality=quality)
            return os.path.getsize(path)
        torch, _ = torch_modules()
        arr = pixels_torch(torch, rng, w, h).permute(1, 2, 0).contiguous()
        Image.frombytes("RGB", (w, h), bytes(arr.flatten().tolist())).save(path, "JPEG", quality=quality)
        return os.path.getsize(path)
    torch, tvio = torch_modules()
    if np is not None:
        chw = torch.from_numpy(pixels_numpy(rng, w, h)).permute(2, 0, 1).contiguous()
    else:
        chw = pixels_torch(torch, rng, w, h)
    data = tvio.encode_jpeg(chw, quality=quality)
    with open(path, "wb") as f:
        f.write(bytes(data.numpy()) if np is not None else bytes(data.tolist()))
    return os.path.getsize(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=3072, help="training images")
    ap.add_argument("--val-count", type=int, default=0, help="validation images")
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--width", type=int, default=500)
    ap.add_argument("--height", type=int, default=375)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    if Image is None and torch_modules()[0] is None:
        sys.exit("error: gen-jpegs.py needs Pillow (pip install pillow) or torch + torchvision to encode JPEGs")
    if np is None and torch_modules()[0] is None:
        sys.exit("error: gen-jpegs.py needs numpy (pip install numpy) or torch to make the pixels")
    if a.count < 1 or a.classes < 1 or a.val_count < 0:
        sys.exit("error: --count and --classes must be at least 1, --val-count at least 0")
    jobs = []
    for split, count, salt in (("train", a.count, 0), ("val", a.val_count, 1)):
        for c in range(a.classes if count else 0):
            os.makedirs(os.path.join(a.out, split, f"class_{c:02d}"), exist_ok=True)
        for i in range(count):
            path = os.path.join(a.out, split, f"class_{i % a.classes:02d}", f"img_{i:06d}.JPEG")
            jobs.append((path, (a.seed * 1000003 + salt) * 10000019 + i, a.width, a.height, a.quality))
    if a.jobs > 1:
        import multiprocessing

        with multiprocessing.Pool(a.jobs) as pool:
            sizes = pool.map(write_one, jobs, chunksize=16)
    else:
        sizes = [write_one(j) for j in jobs]
    encoder = "PIL" if Image is not None else "torchvision.io"
    mean_kb = sum(sizes) / len(sizes) / 1000
    print(f"wrote {len(sizes)} {a.width}x{a.height} JPEGs (quality {a.quality}, {encoder}, mean {mean_kb:.1f} KB) to {a.out}")


if __name__ == "__main__":
    main()
