import pytest
import torch

from speedrun.data.augment.batch import (BatchAugment, alternating_flip_mask, crop, cutout, flip,
                                   reflect_pad)
from speedrun.data.pipeline.resident import ResidentData
from speedrun.recipe import AugmentConfig


def test_crop_matches_slicing_each_image():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 12, 12, generator=g)
    top, left = torch.randint(0, 5, (16,), generator=g), torch.randint(0, 5, (16,), generator=g)
    out = crop(x, top, left, (8, 8))
    for i in range(16):
        t, l = int(top[i]), int(left[i])
        assert torch.equal(out[i], x[i, :, t:t + 8, l:l + 8])


def test_centre_crop_of_reflect_padding_is_the_image_and_borders_mirror():
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).reshape(2, 1, 4, 4)
    p = reflect_pad(x, 2)
    assert torch.equal(crop(p, torch.full((2,), 2), torch.full((2,), 2), (4, 4)), x)
    # reflection without repeating the edge: column -1 equals column 1
    assert torch.equal(p[:, :, 2:6, 1], x[:, :, :, 1])


def test_flip_mirrors_only_masked_images():
    x = torch.randn(4, 3, 5, 5)
    mask = torch.tensor([True, False, True, False])
    out = flip(x, mask)
    assert torch.equal(out[0], x[0].flip(2)) and torch.equal(out[1], x[1])
    assert torch.equal(out[2], x[2].flip(2)) and torch.equal(out[3], x[3])


def test_alternating_flip_flips_each_image_on_exactly_every_other_epoch():
    aug = BatchAugment(AugmentConfig(flip="alternating"), 1000, (8, 8), torch.Generator().manual_seed(1),
                       torch.device("cpu"))
    masks = torch.stack([aug.draw(e)["flip"] for e in range(8)])          # epochs x images
    assert masks.sum(0).tolist() == [4] * 1000                           # half of the epochs each
    assert torch.all(masks[1:] != masks[:-1])                             # never twice in a row
    assert 400 < int(masks[0].sum()) < 600                                # epoch 0 is a fair coin
    assert torch.equal(alternating_flip_mask(masks[0], 3), ~masks[0])


def test_cutout_zeroes_a_square_clipped_at_the_border():
    x = torch.ones(3, 2, 10, 10)
    out = cutout(x, torch.tensor([2, -2, 7]), torch.tensor([3, -2, 7]), 4)
    assert out[0, :, 2:6, 3:7].abs().sum() == 0 and out[0].eq(0).sum() == 2 * 16
    assert out[1].eq(0).sum() == 2 * 4 and out[1, :, :2, :2].abs().sum() == 0
    assert out[2].eq(0).sum() == 2 * 9 and out[2, :, 7:, 7:].abs().sum() == 0


def test_draws_are_reproducible_from_the_seed():
    def draws(seed):
        aug = BatchAugment(AugmentConfig(flip="random", translate=2, cutout=4), 100, (8, 8),
                           torch.Generator().manual_seed(seed), torch.device("cpu"))
        return aug.draw(0)
    a, b, c = draws(5), draws(5), draws(6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["top"], c["top"])
    assert int(a["top"].max()) <= 4 and int(a["top"].min()) >= 0


def test_resident_data_stays_uint8_and_epochs_are_permutations(fashion):
    data = ResidentData(fashion, torch.device("cpu"), torch.float32, torch.channels_last, translate=2)
    assert data.train.shape == (60_000, 1, 28, 28) and data.train.dtype == torch.uint8   # no float copy
    assert data.train.is_contiguous(memory_format=torch.channels_last)
    x = fashion.train_x.double()
    assert data.mean.item() == pytest.approx(x.mean().item(), rel=1e-6)
    assert data.std.item() == pytest.approx(x.std().item(), rel=1e-6)
    sample = data.whitening_sample(60_000)
    assert sample.shape == (60_000, 1, 28, 28)
    assert abs(float(sample.mean())) < 1e-3 and abs(float(sample.std()) - 1) < 1e-3
    aug = BatchAugment(AugmentConfig(translate=2), data.n_train, data.image_size, torch.Generator().manual_seed(0),
                       data.device)
    batches = list(data.epoch(0, 7_000, aug, torch.Generator().manual_seed(0)))
    assert len(batches) == 8                                           # last partial batch dropped
    x, y = batches[0]
    assert x.shape == (7_000, 1, 28, 28) and x.is_contiguous(memory_format=torch.channels_last)
    labels = torch.cat([b[1] for b in batches])
    assert torch.bincount(labels, minlength=10).sum() == 56_000


def test_an_epoch_visits_distinct_images_in_a_new_order(fashion):
    data = ResidentData(fashion, torch.device("cpu"), torch.float32, torch.contiguous_format, translate=0)
    aug = BatchAugment(AugmentConfig(flip="none"), data.n_train, data.image_size, torch.Generator().manual_seed(0),
                       data.device)
    w = torch.randn(1 * 28 * 28, dtype=torch.float64)
    fingerprint = lambda x: (x.flatten(1).double() @ w)
    known = sorted(round(v, 6) for v in fingerprint(data.normalise(data.train)).tolist())   # the set has duplicates
    orders = []
    for seed in (0, 1):
        seen = torch.cat([fingerprint(x) for x, _ in data.epoch(0, 10_000, aug, torch.Generator().manual_seed(seed))])
        rounded = [round(v, 6) for v in seen.tolist()]
        assert sorted(rounded) == known                                  # every image once
        orders.append(rounded)
    assert orders[0] != orders[1]


def test_translation_keeps_the_size_of_the_images_it_is_given():
    """Progressive resizing hands smaller images than the recipe's size (the streamed
    pipeline decodes at the epoch's size): the crop returns that size, from inside the padding,
    and the cutout holes land inside the smaller image too."""
    g = torch.Generator().manual_seed(0)
    aug = BatchAugment(AugmentConfig(translate=2, cutout=4, flip="none"), 64, (32, 32), g, torch.device("cpu"))
    draws = aug.draw(0)
    for size in (16, 24, 32):
        x = torch.arange(64 * size * size, dtype=torch.float32).reshape(64, 1, size, size) + 1
        out = aug(reflect_pad(x, 2), torch.arange(64), draws)
        assert out.shape == (64, 1, size, size)
        assert (out == 0).flatten(1).any(1).all()                 # every image got its hole
