"""The strong view's photometric ops: the reference's parameters, drawn from the seeded global stream."""

from __future__ import annotations

import torch
from torchvision.transforms import v2

from wsod.data.strong_augmentation import strong_augmentation


def test_the_ops_and_their_parameters_are_the_references():
    ops = strong_augmentation().transforms
    jitter, grayscale, blur, *erasing = ops
    assert isinstance(jitter, v2.RandomApply) and jitter.p == 0.8
    (color,) = jitter.transforms
    assert color.brightness == (0.6, 1.4) and color.contrast == (0.6, 1.4) and color.saturation == (0.6, 1.4)
    assert color.hue == (-0.1, 0.1)
    assert isinstance(grayscale, v2.RandomGrayscale) and grayscale.p == 0.2
    assert isinstance(blur, v2.RandomApply) and blur.p == 0.5
    (gaussian,) = blur.transforms
    assert gaussian.sigma == [0.1, 2.0] and list(gaussian.kernel_size) == [13, 13]
    expected = [
        (0.7, (0.05, 0.2), (0.3, 3.3)),
        (0.5, (0.02, 0.2), (0.1, 6.0)),
        (0.3, (0.02, 0.2), (0.05, 8.0)),
    ]
    assert [(e.p, tuple(e.scale), tuple(e.ratio)) for e in erasing] == expected
    assert all(e.value is None for e in erasing)  # torchvision's "random": standard-normal noise


def test_a_strong_view_is_a_function_of_the_seed_and_keeps_the_image_shape():
    image = torch.rand(3, 40, 64, generator=torch.Generator().manual_seed(0))
    augment = strong_augmentation()
    views = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        views.append(augment(image))
    assert views[0].shape == image.shape and views[0].dtype == torch.float32
    assert torch.equal(views[0], views[1]) and not torch.equal(views[0], views[2])
    assert torch.equal(image, torch.rand(3, 40, 64, generator=torch.Generator().manual_seed(0)))  # untouched


def test_the_erasing_passes_fire_as_often_as_their_probabilities_say():
    # A view keeps every pixel in place only when all three passes skip: 0.3 x 0.5 x 0.7 = 0.105 of the
    # draws. An erased rectangle (at least 2% of the image, standard-normal noise) leaves the 0-1 range.
    augment = strong_augmentation()
    erased = 0
    for seed in range(300):
        torch.manual_seed(seed)
        out = augment(torch.full((3, 32, 32), 0.5))
        erased += bool(((out < 0) | (out > 1)).any())
    assert 0.85 <= erased / 300 <= 0.94  # 0.895, binomial standard deviation 0.018
