"""Read a curves PNG back: which cells of its 2-column panel grid hold a drawn curve."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CURVE_RGB = (31, 119, 180)  # matplotlib's first line colour, "C0" (#1f77b4): the first curve of every panel
COLS, ROW_PX, WIDTH_PX = 2, 280, 1000  # plot.py: 2 columns, figsize (10, 2.8 per row) at 100 dpi


def curve_cells(path: str | Path) -> list[list[bool]]:
    """[rows][COLS]: True where the grid cell contains pixels of a C0 curve. Checks the image size first."""
    from PIL import Image

    img = np.asarray(Image.open(path).convert("RGB")).astype(int)  # [H, W, 3]
    h, w, _ = img.shape
    assert w == WIDTH_PX and h % ROW_PX == 0, f"unexpected curves image size {w}x{h}"
    curve = (np.abs(img - np.array(CURVE_RGB)).sum(-1) <= 12)  # [H, W]
    return [
        [bool(curve[r * ROW_PX : (r + 1) * ROW_PX, c * w // COLS : (c + 1) * w // COLS].sum() >= 20) for c in range(COLS)]
        for r in range(h // ROW_PX)
    ]
