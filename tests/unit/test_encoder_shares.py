"""Images dealt over a sequence group (xpar_zoo.styles.encoder_shares): contiguous shares of about equal rows, in
image order, every image in exactly one share; a share's pixel rows and per-image inputs cut together."""

import torch

from xpar_zoo.styles.encoder_shares import deal, image_rows, take


def test_shares_are_contiguous_balanced_and_cover_every_image_once():
    assert deal([16, 16], 2) == [range(0, 1), range(1, 2)]
    assert deal([16], 2) == [range(0), range(0, 1)]  # the first rank encodes the dummy
    assert deal([4, 4, 4, 4, 16], 2) == [range(0, 4), range(4, 5)]
    shares = deal([3, 1, 4, 1, 5, 9, 2, 6], 4)
    assert [i for s in shares for i in s] == list(range(8))


def test_a_share_takes_its_images_pixel_rows_and_grid_rows():
    grid = torch.tensor([[1, 2, 2], [1, 4, 4], [1, 2, 4]])
    pixels = torch.arange(4 + 16 + 8)[:, None].float()
    sizes = image_rows(pixels, {"image_grid_thw": grid}, "image_grid_thw")
    assert sizes == [4, 16, 8]
    part, kwargs = take(pixels, {"image_grid_thw": grid, "other": 3}, sizes, range(1, 3))
    assert part.flatten().tolist() == list(range(4, 28)) and kwargs["image_grid_thw"].tolist() == grid[1:].tolist()
    assert kwargs["other"] == 3
    assert image_rows(torch.zeros(5, 36, 48), {}, "image_grid_thw") == [1] * 5  # one image a row
