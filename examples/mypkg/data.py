"""Tetrominoes: images of the seven tetris pieces, each at a random position and quarter
turn, with pixel noise; the label is the piece. A class of the user's own, built by
``_target_: mypkg.data.Tetrominoes``."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

PIECES = {  # cells (row, column) of each piece
    "I": [(0, 0), (0, 1), (0, 2), (0, 3)],
    "O": [(0, 0), (0, 1), (1, 0), (1, 1)],
    "T": [(0, 0), (0, 1), (0, 2), (1, 1)],
    "S": [(0, 1), (0, 2), (1, 0), (1, 1)],
    "Z": [(0, 0), (0, 1), (1, 1), (1, 2)],
    "J": [(0, 0), (1, 0), (1, 1), (1, 2)],
    "L": [(0, 2), (1, 0), (1, 1), (1, 2)],
}


class Tetrominoes:
    """``train``, ``val`` and ``test`` splits of ``(x (1, S, S) float32, y int)``, with
    ``num_classes``, ``in_channels`` and ``image_size`` S, the facts a model is sized by.
    Cells are ``cell`` pixels wide; ``noise`` is the pixel noise's standard deviation."""

    in_channels = 1
    num_classes = len(PIECES)

    def __init__(
        self,
        num_train: int = 700,
        num_val: int = 140,
        num_test: int = 280,
        image_size: int = 16,
        cell: int = 2,
        noise: float = 0.1,
        seed: int = 0,
    ):
        if image_size < 4 * cell:
            raise ValueError(
                f"image_size={image_size} cannot hold a piece of 4 cells of "
                f"{cell} pixels; use image_size >= {4 * cell}"
            )
        self.image_size = image_size
        generator = torch.Generator().manual_seed(seed)
        sizes = (num_train, num_val, num_test)
        self.train, self.val, self.test = (self._split(n, cell, noise, generator) for n in sizes)

    def _split(self, count: int, cell: int, noise: float, generator) -> TensorDataset:
        side = self.image_size
        labels = torch.randint(0, len(PIECES), (count,), generator=generator)
        images = noise * torch.randn(count, 1, side, side, generator=generator)
        for index, label in enumerate(labels.tolist()):
            piece = torch.zeros(4 * cell, 4 * cell)
            for row, column in PIECES[list(PIECES)[label]]:
                piece[row * cell : (row + 1) * cell, column * cell : (column + 1) * cell] = 1.0
            turns = int(torch.randint(0, 4, (1,), generator=generator))
            piece = torch.rot90(piece, turns)
            top, left = torch.randint(0, side - 4 * cell + 1, (2,), generator=generator).tolist()
            images[index, 0, top : top + 4 * cell, left : left + 4 * cell] += piece
        return TensorDataset(images, labels)
