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


class CallSizes(nn.Module):
    """_model(), recording the batch size of each call."""

    def __init__(self):
        super().__init__()
        self.inner, self.sizes = _model(), []

    def forward(self, x):
        self.sizes.append(len(x))
        return self.inner(x)


@pytest.mark.parametrize("tta, fraction", [("none", 1.0), ("flip_translate", 1.0), ("flip_translate", 0.25)])
def test_a_batch_in_chunks_gives_its_logits_in_calls_of_one_size_with_a_stop_check_between(tta, fraction):
    """Each view of a 50-image batch in calls of at most 16 images: 4 equal calls of 13 (the last
    holding 2 zero images, whose logits are dropped), the stop check before every call but the
    first (between views too), and the same logits as the whole batch in one call."""
    model = CallSizes()
    x = torch.randn(50, 3, 10, 10)
    model(x)
    model.eval()
    whole_total, whole_plain = tta_logits(model, x, tta, fraction=fraction)
    model.sizes.clear()
    checks = []
    total, plain = tta_logits(model, x, tta, fraction=fraction, chunk=16, between=lambda: checks.append(len(model.sizes)))
    views = len(TTA_VIEWS[tta])
    # the other views: of all 50 images, or of the least confident quarter (13, one call)
    assert model.sizes == [13] * 4 + (views - 1) * ([13] * 4 if fraction == 1.0 else [13])
    assert len(checks) == len(model.sizes) - 1 and checks[0] == 1    # between calls, never before the first
    assert torch.allclose(total, whole_total, atol=1e-5) and torch.allclose(plain, whole_plain, atol=1e-5)
    assert total.shape == (50, 5) and total.dtype == torch.float32


def test_a_stop_asked_between_the_calls_of_one_batch_ends_the_evaluation():
    """evaluate() with chunk: a stop signal seen at the check after the first call of the only
    batch raises EvaluationStopped with its number; the model is back in its mode."""
    from speedrun.engine.evaluate import EvaluationStopped
    model = CallSizes()
    x, y = torch.randn(40, 3, 10, 10), torch.randint(0, 5, (40,))
    model(x)
    model.train()
    asked = []

    def stop(running):
        asked.append((running, len(model.sizes)))
        return 15 if len(model.sizes) >= 2 else None
    with pytest.raises(EvaluationStopped) as caught:
        evaluate(model, [(x, y)], "none", chunk=10, stop=stop)
    assert caught.value.signum == 15 and model.sizes[-1] == 10 and len(model.sizes) == 2
    assert (True, 2) in asked and model.training


def test_the_chunk_of_a_cpu_run_is_counted_from_its_flops_and_a_gpu_run_keeps_whole_batches():
    """eval.chunk = "auto": on a CPU the images whose forward passes make 10 GFLOP (at least 1);
    on a GPU, None (whole batches); a number is kept as given; 0 is refused naming the field."""
    from speedrun.engine.evaluate import EVAL_CHUNK_FLOPS, chunk_images
    from speedrun.engine.flops import eval_chunk, per_image_flops
    from speedrun.errors import RecipeError
    from speedrun.recipe import load_recipe
    r = load_recipe("cifar10-94")
    forward = per_image_flops(r, 3, 10, (32, 32))["forward"]
    assert eval_chunk(r, 3, 10, (32, 32), "cpu") == int(EVAL_CHUNK_FLOPS // forward) == chunk_images(forward)
    assert 10 < eval_chunk(r, 3, 10, (32, 32), "cpu") < r.eval.batch_size
    assert eval_chunk(r, 3, 10, (32, 32), "cuda") is None
    assert chunk_images(1e12) == 1
    assert eval_chunk(load_recipe("cifar10-94", ["eval.chunk=300"]), 3, 10, (32, 32), "cuda") == 300
    with pytest.raises(RecipeError, match="eval.chunk"):
        load_recipe("cifar10-94", ["eval.chunk=0"])
