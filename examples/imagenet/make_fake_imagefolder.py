"""Write a small synthetic ImageFolder (``train/`` and ``val/``) to try ``main_amp.py`` without ImageNet.

    python examples/imagenet/make_fake_imagefolder.py /tmp/fake_imagenet --classes 4 --train 16 --val 4

Each class has its own colour and stripe direction, plus noise, so a small network learns to tell them
apart within an epoch or two: the loss falls and the accuracy rises above chance, which shows the
training loop works. JPEG files, written with Pillow.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def class_image(rng: np.random.Generator, label: int, classes: int, size: int) -> np.ndarray:
    """A ``(size, size, 3)`` uint8 image of class ``label``: a hue per class, stripes at a per-class angle, noise."""
    hue = 2 * np.pi * label / classes
    color = 127 + 100 * np.cos(hue + np.array([0.0, 2.1, 4.2]))
    yy, xx = np.mgrid[0:size, 0:size] / size
    angle = np.pi * label / classes
    stripes = np.sin(2 * np.pi * 3 * (xx * np.cos(angle) + yy * np.sin(angle)) + rng.uniform(0, 2 * np.pi))
    img = color[None, None, :] * (0.75 + 0.25 * stripes[..., None]) + rng.normal(0, 20, (size, size, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def make_imagefolder(root: str | Path, classes: int = 4, train: int = 16, val: int = 4, size: int = 40,
                     seed: int = 0) -> Path:
    """Write ``root/{train,val}/class_<i>/<n>.jpg`` and return ``root``."""
    from PIL import Image

    if classes < 2:
        raise ValueError(f"classes must be >= 2, got {classes}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(count):
                Image.fromarray(class_image(rng, c, classes, size)).save(folder / f"{n:05d}.jpg", quality=95)
    return root


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", help="folder to create")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--train", type=int, default=16, help="training images per class")
    p.add_argument("--val", type=int, default=4, help="validation images per class")
    p.add_argument("--size", type=int, default=40, help="image side in pixels")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    root = make_imagefolder(a.root, a.classes, a.train, a.val, a.size, a.seed)
    print(f"wrote {a.classes} classes x ({a.train} train + {a.val} val) images of {a.size}x{a.size} to {root}")


if __name__ == "__main__":
    main()
