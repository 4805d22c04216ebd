import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from speedrun.engine.evaluate import TTA_VIEWS, evaluate, tta_logits


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(5))


@pytest.mark.parametrize("tta", ["none", "flip", "flip_translate"])
def test_tta_equals_the_weighted_mean_of_its_views(tta):
    model = _model()
    x = torch.randn(6, 3, 10, 10)
    model(x)
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    views = {
        "none": [(1.0, x)],
        "flip": [(0.5, x), (0.5, x.flip(3))],
        "flip_translate": [(0.25, x), (0.25, x.flip(3)),
                           (0.125, padded[:, :, :10, :10]), (0.125, padded[:, :, :10, :10].flip(3)),
                           (0.125, padded[:, :, 2:, 2:]), (0.125, padded[:, :, 2:, 2:].flip(3))],
    }[tta]
    expected = sum(w * model(v) for w, v in views)
    total, plain = tta_logits(model, x, tta)
    assert torch.allclose(total, expected, atol=1e-6)
    assert torch.allclose(plain, model(x))
    assert sum(w for w, _ in TTA_VIEWS[tta]) == pytest.approx(1.0)


def test_translated_views_shift_by_one_pixel():
    x = torch.arange(36.0).reshape(1, 1, 6, 6).expand(1, 3, 6, 6)
    down_right = TTA_VIEWS["flip_translate"][2][1](x)
    assert torch.equal(down_right[..., 1:, 1:], x[..., :-1, :-1])


def test_evaluate_counts_match_a_direct_computation():
    model = _model()
    x, y = torch.randn(50, 3, 10, 10), torch.randint(0, 5, (50,))
    model(x)
    model.train()
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 50, 16)]
    c_tta, c_plain, n = evaluate(model, batches, "flip")
    assert n == 50
    with torch.no_grad():
        logits = 0.5 * model(x) + 0.5 * model(x.flip(3))
        assert int(c_tta) == int((logits.argmax(1) == y).sum())
        assert int(c_plain) == int((model(x).argmax(1) == y).sum())
    assert model.training                                      # mode restored
