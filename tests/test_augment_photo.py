
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speedrun.data.augment.colour import (IMAGENET_EIGVAL, IMAGENET_EIGVEC, LUMA_WEIGHTS, color_jitter, lighting,
                                  sample_jitter, sample_lighting, sample_shift_and_scale, shift_and_scale)
from speedrun.data.augment.mixing import apply_mix, draw_mix
from speedrun.engine.loss import mixed_loss
from speedrun.data.augment.resized_crop import random_resized_crop, sample_rrc_boxes, supersampling

MEAN3, STD3 = torch.tensor([0.49, 0.48, 0.45]), torch.tensor([0.25, 0.24, 0.26])
MEAN1, STD1 = torch.tensor([0.29]), torch.tensor([0.35])
CPU = torch.device("cpu")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def pixels(n, c, h, w, seed=0, lo=0.0, hi=1.0):
    """Random images in the 0..1 pixel scale."""
    return lo + (hi - lo) * torch.rand(n, c, h, w, generator=gen(seed))


def normalise(p, mean, std):
    return (p - mean[:, None, None]) / std[:, None, None]


def unnormalise(x, mean, std):
    return x * std[:, None, None] + mean[:, None, None]


# ------------------------------------------------------------------------------------------
# Random-resized crop
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", [1, 3])
def test_rrc_of_the_whole_image_is_the_image(c):
    x = torch.randn(4, c, 12, 20)
    boxes = torch.tensor([[0, 0, 12, 20]] * 4)
    assert torch.allclose(random_resized_crop(x, boxes, (12, 20)), x, atol=1e-5)


def test_rrc_of_a_quarter_is_a_bilinear_upsample_of_the_slice():
    x = torch.randn(2, 3, 16, 16)
    out = random_resized_crop(x, torch.tensor([[0, 0, 8, 8]] * 2), (16, 16))
    ref = F.interpolate(x[:, :, :8, :8], size=(16, 16), mode="bilinear", align_corners=False)
    # equal except the far row and column: grid_sample reads the neighbouring pixel just
    # outside the box there, where interpolate repeats the slice's last pixel
    assert torch.allclose(out[:, :, :-1, :-1], ref[:, :, :-1, :-1], atol=1e-5)


def test_rrc_halving_each_box_averages_2x2_blocks_of_it():
    x = torch.randn(3, 2, 16, 16)
    boxes = torch.tensor([[0, 0, 8, 8], [4, 6, 8, 8], [8, 2, 8, 8]])
    out = random_resized_crop(x, boxes, (4, 4))
    for i, (t, l, h, w) in enumerate(boxes.tolist()):
        assert torch.allclose(out[i], F.avg_pool2d(x[i, :, t:t + h, l:l + w], 2), atol=1e-5)


def test_rrc_shrinking_three_times_reads_one_pixel_in_nine_unless_supersampled():
    x = torch.randn(2, 3, 24, 24)
    whole = torch.tensor([[0, 0, 24, 24]] * 2)
    # plain bilinear sampling: each output pixel is the input pixel at its centre (aliasing)
    assert torch.allclose(random_resized_crop(x, whole, (8, 8)), x[:, :, 1::3, 1::3], atol=1e-5)
    # supersampled 3 x 3: each output pixel is the mean of its 3 x 3 footprint (an area filter)
    assert torch.allclose(random_resized_crop(x, whole, (8, 8), supersample=3), F.avg_pool2d(x, 3), atol=1e-5)


def test_supersampling_follows_the_shrink_of_the_stored_images():
    assert supersampling(224, 128, True) == 2 and supersampling(224, 96, True) == 2
    assert supersampling(160, 128, True) == 1 and supersampling(160, 96, True) == 2
    assert supersampling(512, 32, True) == 4                       # at most 4 x 4 samples a pixel
    assert supersampling(224, 96, False) == 1                      # off: plain bilinear sampling


def test_rrc_in_bf16_keeps_the_dtype_and_the_geometry():
    x = torch.randn(2, 3, 12, 12)
    boxes = torch.tensor([[0, 0, 12, 12], [2, 4, 8, 6]])
    out = random_resized_crop(x.bfloat16(), boxes, (10, 10))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), random_resized_crop(x, boxes, (10, 10)), atol=0.05)


def test_sampled_rrc_boxes_lie_inside_with_area_and_aspect_in_range():
    h, w, scale, ratio = 96, 160, (0.08, 1.0), (3 / 4, 4 / 3)
    boxes = sample_rrc_boxes(4000, h, w, scale, ratio, gen(0), CPU)
    assert boxes.shape == (4000, 4) and boxes.dtype == torch.int64
    top, left, bh, bw = boxes.double().unbind(1)
    assert bool((top >= 0).all() and (left >= 0).all() and (bh >= 1).all() and (bw >= 1).all())
    assert bool((top + bh <= h).all() and (left + bw <= w).all())
    # the unrounded sides lie within half a pixel of the rounded ones
    assert bool(((bh - 0.5) * (bw - 0.5) <= scale[1] * h * w).all())
    assert bool(((bh + 0.5) * (bw + 0.5) >= scale[0] * h * w).all())
    assert bool(((bw - 0.5) / (bh + 0.5) <= ratio[1]).all() and ((bw + 0.5) / (bh - 0.5) >= ratio[0]).all())
    # positions are uniform over the valid range
    assert abs(float((top / (h - bh).clamp(min=1)).mean()) - 0.5) < 0.05
    # on a square image, tall and wide boxes fit equally often: log-aspect is centred on 0
    _, _, bh, bw = sample_rrc_boxes(4000, 64, 64, scale, ratio, gen(1), CPU).double().unbind(1)
    assert abs(float((bw / bh).log().mean())) < 0.02


def test_rrc_falls_back_to_a_centre_crop_within_the_ratio_range():
    # aspect >= 2 and the whole area never fits a 40x40 image: every image falls back
    boxes = sample_rrc_boxes(8, 40, 40, (1.0, 1.0), (2.0, 3.0), gen(0), CPU)
    assert boxes.tolist() == [[10, 0, 20, 40]] * 8
    boxes = sample_rrc_boxes(8, 40, 20, (1.0, 1.0), (0.75, 4 / 3), gen(0), CPU)
    assert boxes.tolist() == [[6, 0, 27, 20]] * 8                          # 20 / 0.75 = 26.7


def test_rrc_boxes_are_reproducible_from_the_seed():
    draw = lambda s: sample_rrc_boxes(64, 32, 32, (0.08, 1), (0.75, 4 / 3), gen(s), CPU)
    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))


# ------------------------------------------------------------------------------------------
# Colour jitter and lighting
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mean, std", [(MEAN1, STD1), (MEAN3, STD3)])
def test_jitter_with_factors_one_is_the_identity(mean, std):
    x = normalise(pixels(4, len(mean), 6, 6), mean, std)
    ones = torch.ones(4)
    assert torch.allclose(color_jitter(x, ones, ones, ones, mean, std), x, atol=1e-5)


def test_brightness_scales_unnormalised_pixels_per_image():
    p = pixels(3, 3, 5, 5, hi=0.5)
    b = torch.tensor([0.6, 1.0, 1.9])
    out = color_jitter(normalise(p, MEAN3, STD3), b, torch.ones(3), torch.ones(3), MEAN3, STD3)
    assert torch.allclose(unnormalise(out, MEAN3, STD3), p * b[:, None, None, None], atol=1e-5)


def test_contrast_zero_gives_the_mean_grey_everywhere():
    p = pixels(2, 3, 5, 5)
    out = unnormalise(color_jitter(normalise(p, MEAN3, STD3), torch.ones(2), torch.zeros(2), torch.ones(2),
                                   MEAN3, STD3), MEAN3, STD3)
    grey = sum(wt * p[:, i] for i, wt in enumerate(LUMA_WEIGHTS)).mean((1, 2))
    assert torch.allclose(out, grey[:, None, None, None].expand_as(out), atol=1e-5)


def test_saturation_zero_gives_grey_images_and_leaves_one_channel_alone():
    p = pixels(2, 3, 5, 5)
    out = unnormalise(color_jitter(normalise(p, MEAN3, STD3), torch.ones(2), torch.ones(2), torch.zeros(2),
                                   MEAN3, STD3), MEAN3, STD3)
    grey = sum(wt * p[:, i] for i, wt in enumerate(LUMA_WEIGHTS))
    assert torch.allclose(out, grey[:, None].expand_as(out), atol=1e-5)   # all channels equal
    x1 = normalise(pixels(2, 1, 5, 5), MEAN1, STD1)
    out1 = color_jitter(x1, torch.ones(2), torch.ones(2), torch.zeros(2), MEAN1, STD1)
    assert torch.allclose(out1, x1, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jittered_pixels_stay_in_range(dtype):
    x = normalise(pixels(64, 3, 4, 4), MEAN3, STD3).to(dtype)
    f = sample_jitter(64, 0.9, gen(0), CPU)
    assert f.shape == (3, 64) and bool((f >= 0.1).all() and (f <= 1.9).all())
    out = color_jitter(x, *f, MEAN3, STD3)
    assert out.dtype == dtype
    p = unnormalise(out.float(), MEAN3, STD3)
    assert float(p.min()) >= -1e-2 and float(p.max()) <= 1 + 1e-2
    assert float(p.max()) > 0.999                                          # bright images clipped


def test_shift_and_scale_moves_each_image_by_its_own_amounts():
    x = torch.randn(3, 3, 5, 5, generator=gen(1))
    shift, scale = torch.tensor([0.0, 0.5, -0.2]), torch.tensor([1.0, 1.0, 0.8])
    out = shift_and_scale(x, shift, scale)
    assert torch.equal(out[0], x[0])                                       # (0, 1) is the identity
    assert torch.allclose(out[1], x[1] + 0.5)                              # every channel, no clipping
    assert torch.allclose(out[2], (x[2] - 0.2) * 0.8)
    assert shift_and_scale(x.bfloat16(), shift, scale).dtype == torch.bfloat16


def test_shift_and_scale_factors_fill_their_ranges():
    f = sample_shift_and_scale(20000, 0.14, 0.13, gen(0), CPU)
    assert f.shape == (20000, 2)
    shift, scale = f.unbind(1)
    assert float(shift.abs().max()) <= 0.14 and float(shift.abs().max()) > 0.139
    assert float((scale - 1).abs().max()) <= 0.13 and float((scale - 1).abs().max()) > 0.129
    assert abs(float(shift.mean())) < 0.005 and abs(float(scale.mean()) - 1) < 0.005
    assert torch.equal(sample_shift_and_scale(5, 0.1, 0.1, gen(3), CPU), sample_shift_and_scale(5, 0.1, 0.1, gen(3), CPU))


def test_batch_augment_applies_the_shift_and_scale_it_drew():
    from speedrun.data.augment.batch import BatchAugment
    from speedrun.recipe import AugmentConfig
    cfg = AugmentConfig(flip="none", brightness=0.3, contrast=0.2)
    aug = BatchAugment(cfg, 6, (4, 4), gen(0), CPU, MEAN3 * 255, STD3 * 255)
    r = aug.draw(0)
    assert set(r) == {"shift_scale"}
    x, idx = torch.randn(3, 3, 4, 4), torch.tensor([5, 0, 2])
    shift, scale = r["shift_scale"][idx].unbind(1)
    assert torch.allclose(aug(x, idx, r), (x + shift[:, None, None, None]) * scale[:, None, None, None])
    assert not torch.equal(aug(x, idx, r), x)
    assert "shift_scale" not in BatchAugment(AugmentConfig(), 6, (4, 4), gen(0), CPU).draw(0)


def test_lighting_adds_a_constant_colour_along_the_eigenvectors():
    x = torch.randn(5, 3, 4, 4)
    alpha = sample_lighting(5, 0.1, gen(0), CPU)
    out = lighting(x, alpha, IMAGENET_EIGVAL, IMAGENET_EIGVEC, STD3)
    shift = (out - x) * STD3[:, None, None]                                 # pixel units
    assert torch.allclose(shift, shift[:, :, :1, :1].expand_as(shift), atol=1e-6)
    colour = shift[:, :, 0, 0]
    assert torch.allclose(colour, (alpha * IMAGENET_EIGVAL) @ IMAGENET_EIGVEC.T, atol=1e-6)
    # the eigenvectors are orthonormal (to the 4 published digits): projecting recovers alpha
    assert torch.allclose(colour @ IMAGENET_EIGVEC, alpha * IMAGENET_EIGVAL, atol=1e-4)


def test_lighting_is_the_identity_for_alpha_zero_and_for_grey_images():
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(lighting(x, torch.zeros(2, 3), IMAGENET_EIGVAL, IMAGENET_EIGVEC, STD3), x)
    x1 = torch.randn(2, 1, 4, 4)
    assert torch.equal(lighting(x1, torch.ones(2, 3), IMAGENET_EIGVAL, IMAGENET_EIGVEC, STD1), x1)
    out = lighting(x.bfloat16(), torch.ones(2, 3), IMAGENET_EIGVAL, IMAGENET_EIGVEC, STD3)
    assert out.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------
# Mixup and CutMix
# ------------------------------------------------------------------------------------------

def mix_batch(x, y, mixup_alpha, cutmix_alpha, prob, rng):
    """One step's mixing as the training step applies it: drawn on the host (draw_mix), applied
    to the batch and its reverse (apply_mix); (x, y, y_partner, lam), an unmixed batch as it is."""
    pixel_lam, box, lam = draw_mix(mixup_alpha, cutmix_alpha, prob, *x.shape[2:], rng)
    if lam == 1.0 and box == (0, 0, 0, 0):
        return x, y, y, 1.0
    return apply_mix(x, pixel_lam, box), y, y.flip(0), lam


def mixed_targets(y, y_partner, lam, num_classes, smoothing):
    """The reference the loss is checked against: lam * smooth(onehot(y)) + (1 - lam) *
    smooth(onehot(y_partner)), smooth(t) = (1 - smoothing) t + smoothing / K, the target of
    F.cross_entropy's label smoothing."""
    def smooth(labels):
        return (1 - smoothing) * F.one_hot(labels, num_classes).float() + smoothing / num_classes
    return lam * smooth(y) + (1 - lam) * smooth(y_partner)


def test_an_unmixed_batch_is_returned_unchanged():
    x, y = torch.randn(4, 3, 6, 6), torch.arange(4)
    for args in [(1.0, 1.0, 0.0), (0.0, 0.0, 1.0)]:
        xm, ya, yb, lam = mix_batch(x, y, *args, np.random.default_rng(0))
        assert xm is x and torch.equal(ya, y) and torch.equal(yb, y) and lam == 1.0


def test_mixup_blends_each_image_with_the_reversed_batch():
    x, y = torch.randn(4, 3, 6, 6), torch.arange(4)
    xm, ya, yb, lam = mix_batch(x, y, 0.4, 0.0, 1.0, np.random.default_rng(0))
    assert isinstance(lam, float) and 0 < lam < 1
    assert torch.allclose(xm, lam * x + (1 - lam) * x.flip(0))
    assert torch.equal(ya, y) and torch.equal(yb, y.flip(0))


def test_cutmix_lambda_is_the_unpasted_area_fraction():
    x, y = torch.randn(4, 2, 9, 7), torch.arange(4)        # an even batch: no image is its own partner
    rng = np.random.default_rng(1)
    for _ in range(50):
        xm, _, yb, lam = mix_batch(x, y, 0.0, 1.0, 1.0, rng)
        pasted = xm != x
        assert torch.equal(pasted, pasted[:1, :1].expand_as(pasted))       # one box for all
        assert torch.equal(xm[pasted], x.flip(0)[pasted])                   # from the partner
        rows, cols = pasted[0, 0].any(1), pasted[0, 0].any(0)
        assert int(pasted[0, 0].sum()) == int(rows.sum()) * int(cols.sum())  # a rectangle
        assert lam == 1 - int(pasted[0, 0].sum()) / (9 * 7)
        assert torch.equal(yb, y.flip(0))


def test_mixing_is_fixed_by_the_seed_and_picks_both_methods():
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    def run(seed):
        rng = np.random.default_rng(seed)
        return [mix_batch(x, y, 1.0, 1.0, 0.5, rng) for _ in range(200)]
    a, b, c = run(7), run(7), run(8)
    assert all(torch.equal(p[0], q[0]) and p[3] == q[3] for p, q in zip(a, b))
    assert [p[3] for p in a] != [p[3] for p in c]
    unmixed = sum(p[0] is x for p in a)
    cutmix = sum(p[0] is not x and bool((p[0] == x).any()) for p in a)
    mixup = 200 - unmixed - cutmix
    assert 70 < unmixed < 130 and 25 < cutmix < 75 and 25 < mixup < 75


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_mixed_loss_is_cross_entropy_against_mixed_targets(smoothing):
    g = gen(0)
    logits, y = torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g)
    for lam in [1.0, 0.7, 0.25]:
        t = mixed_targets(y, y.flip(0), lam, 5, smoothing)
        assert torch.allclose(t.sum(1), torch.ones(6))
        assert torch.allclose(mixed_loss(logits, y, y.flip(0), lam, smoothing), F.cross_entropy(logits, t))
    t = mixed_targets(y, y.flip(0), 1.0, 5, 0.0)
    assert torch.equal(t, F.one_hot(y, 5).float())


# ------------------------------------------------------------------------------------------
# No host synchronisation
# ------------------------------------------------------------------------------------------

SYNCS = ["item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"]


def count_syncs(monkeypatch, fn, *args):
    """Run fn(*args) counting every read-back of a tensor value to the host."""
    calls = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)
        def spy(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, spy)
    fn(*args)
    monkeypatch.undo()
    return calls


def test_no_function_reads_tensors_back_to_the_host(monkeypatch):
    g = gen(0)
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    boxes = sample_rrc_boxes(4, 8, 8, (0.08, 1), (0.75, 4 / 3), g, CPU)
    f = sample_jitter(4, 0.4, g, CPU)
    cases = [
        (sample_rrc_boxes, 4, 8, 8, (0.08, 1), (0.75, 4 / 3), g, CPU),
        (random_resized_crop, x, boxes, (6, 6)),
        (sample_jitter, 4, 0.4, g, CPU),
        (color_jitter, x, *f, MEAN3, STD3),
        (sample_shift_and_scale, 4, 0.1, 0.1, g, CPU),
        (shift_and_scale, x, torch.zeros(4), torch.ones(4)),
        (sample_lighting, 4, 0.1, g, CPU),
        (lighting, x, torch.randn(4, 3), IMAGENET_EIGVAL, IMAGENET_EIGVEC, STD3),
        (mix_batch, x, y, 1.0, 0.0, 1.0, np.random.default_rng(0)),
        (mix_batch, x, y, 0.0, 1.0, 1.0, np.random.default_rng(0)),
        (mixed_targets, y, y.flip(0), 0.3, 5, 0.1),
        (mixed_loss, torch.randn(4, 5), y, y.flip(0), 0.3, 0.1),
    ]
    assert count_syncs(monkeypatch, lambda t: (t.sum().item(), bool(t.any()), t[:2].tolist()), x) == \
        ["item", "__bool__", "tolist"]                                      # the spy sees syncs
    for fn, *args in cases:
        assert count_syncs(monkeypatch, fn, *args) == [], fn.__name__
