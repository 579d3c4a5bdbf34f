"""A folder dataset of toy images (``wsod/data/folder.py`` layout) for the own-data tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from wsod.data.toy import TOY_CLASSES, render_toy_image


def write_image_folder(root: Path, num_train: int = 8, num_test: int = 4, seed: int = 7) -> dict:
    """``root/images/*.jpg`` (toy images, the test ones in a sub-folder) and ``root/labels.csv`` with
    their image-level labels and split; returns ``{file name: (boxes (G, 4) 0-based inclusive, labels)}``."""
    (root / "images" / "more").mkdir(parents=True, exist_ok=True)
    lines, truth = ["image,labels,split"], {}
    for number in range(num_train + num_test):
        image, boxes, labels = render_toy_image(seed, number)
        name = f"img_{number:03d}.jpg" if number < num_train else f"more/img_{number:03d}.jpg"
        Image.fromarray(image).save(root / "images" / name, quality=92)
        present = ";".join(sorted({TOY_CLASSES[c] for c in labels.tolist()}))
        lines.append(f"{name},{present},{'train' if number < num_train else 'test'}")
        truth[name] = (np.asarray(boxes), np.asarray(labels))
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return truth
