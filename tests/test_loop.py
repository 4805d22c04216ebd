"""The training loop on real data (a slice of Fashion-MNIST, small nets, few steps)."""
import dataclasses

import pytest
import torch

from speedrun.engine.loop import Session
from speedrun.engine.runtime import Runtime, resolve_runtime
from speedrun.recipe import RecipeError, RuntimeConfig, load_recipe

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small(fashion):
    return dataclasses.replace(fashion, train_x=fashion.train_x[:8192], train_y=fashion.train_y[:8192],
                               test_x=fashion.test_x[:2000], test_y=fashion.test_y[:2000])


def _recipe(*extra):
    return load_recipe("fashion-mnist", ["model.widths=[8,16,16]", "data.batch_size=512",
                                         "train.epochs=2", "eval.tta=flip", *extra])


def _runtime(**kw):
    return dataclasses.replace(resolve_runtime(RuntimeConfig(), CPU), **kw)


def test_cpu_runtime_defaults_and_refusals():
    rt = resolve_runtime(RuntimeConfig(), CPU)
    assert (rt.precision, rt.compile, rt.channels_last) == ("fp32", False, True)
    assert resolve_runtime(RuntimeConfig(precision="bf16", compile="on"), CPU).compile is True
    with pytest.raises(RecipeError, match="runtime.precision='fp16' is for CUDA"):
        resolve_runtime(RuntimeConfig(precision="fp16"), CPU)


class SyncCounter:
    """Counts the tensor methods that make the host wait for the device."""
    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            def wrapped(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, wrapped)


def test_no_host_sync_inside_a_step(small, monkeypatch):
    recipe = _recipe("eval.every=1")
    session = Session(recipe, small, _runtime())
    assert session.total_steps == 32
    counter = SyncCounter(monkeypatch)
    result = session.run()
    # one read-back per epoch, one monitoring eval, one for the final evaluation
    assert counter.count <= 2 * 2 + 2, counter.count
    assert result.steps == 32 and len(result.history) == 2


def test_batches_use_the_runtime_memory_format(small):
    seen = []
    session = Session(_recipe("train.epochs=0.125"), small, _runtime(channels_last=True))
    handle = session.model.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    session.run()
    handle.remove()
    assert seen and all(x.is_contiguous(memory_format=torch.channels_last) for x in seen)


def test_runs_are_reproducible_and_independent(small):
    session = Session(_recipe(), small, _runtime())
    a, b, c = session.run(seed=1), session.run(seed=1), session.run(seed=2)
    assert a.test_acc == b.test_acc and a.history[0].train_loss == b.history[0].train_loss
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert any(not torch.equal(a.state_dict[k], c.state_dict[k]) for k in a.state_dict)
    assert a.test_acc > 0.5 and c.test_acc > 0.5       # 32 steps of a tiny net: far above chance (0.1)


def test_whitening_bias_stops_training_after_its_epochs(small):
    session = Session(_recipe("model.whiten.train_bias_epochs=1", "averaging.kind=none"), small, _runtime())
    biases = []
    session.model.whiten.register_forward_pre_hook(lambda m, a: biases.append(m.bias.detach().clone()))
    session.run()
    assert len(biases) == 32 + 1 + 2                   # 32 steps, 1 monitoring eval, 2 flip-TTA views
    trained, frozen = biases[:17], biases[16:32]       # 16 steps per epoch
    assert all(not torch.equal(a, b) for a, b in zip(trained, trained[1:]))
    assert all(torch.equal(frozen[0], b) for b in frozen)


def test_bf16_autocast_trains_on_cpu(small):
    result = Session(_recipe(), small, _runtime(precision="bf16")).run()
    assert result.test_acc > 0.5


def test_compiled_model_trains_and_compile_time_is_kept_apart(small):
    recipe = _recipe("train.epochs=1")
    eager = Session(recipe, small, _runtime()).run()
    session = Session(recipe, small, _runtime(compile=True))
    assert session.compile_seconds > 0
    compiled = session.run()
    assert compiled.train_seconds < session.compile_seconds + compiled.train_seconds
    assert abs(compiled.test_acc - eager.test_acc) < 0.03
