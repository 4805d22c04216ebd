import pytest
import torch
import torch.nn.functional as F

from speedrun.models import BatchNorm, PatchWhitening, build_model
from speedrun.models.whitening import image_patches, whiten_patches
from speedrun.recipe import NormConfig, ResNetConfig, SpeedNetConfig, load_recipe


def test_whitened_patches_have_identity_covariance_and_zero_mean(cifar10):
    images = cifar10.train_x[:2000].float() / 255
    images = (images - images.mean((0, 2, 3), keepdim=True)) / images.std((0, 2, 3), keepdim=True)
    for k in (2, 3):
        w, b = whiten_patches(images, k, eps=1e-8)
        out = F.conv2d(images, w, b)                                    # C*k*k channels
        flat = out.permute(1, 0, 2, 3).reshape(out.shape[1], -1).double()
        cov = torch.cov(flat)
        assert torch.allclose(cov, torch.eye(len(cov), dtype=torch.float64), atol=2e-3)
        assert flat.mean(1).abs().max() < 1e-3


def test_whitening_filters_are_ordered_by_variance_and_negation_doubles_width(cifar10):
    images = cifar10.train_x[:500].float() / 255
    layer = PatchWhitening(3, 2, eps=5e-4, negate=True, padding=False)
    assert layer.out_channels == 24 and "weight" in dict(layer.named_buffers())
    layer.fit(images)
    assert torch.equal(layer.weight[12:], -layer.weight[:12])
    patches = image_patches(images, 2)
    var = torch.linalg.eigvalsh(torch.cov(patches.T)).flip(0)
    norms = layer.weight[:12].flatten(1).norm(dim=1)                     # 1/sqrt(var + eps)
    assert torch.allclose(norms, 1 / torch.sqrt(var + 5e-4), rtol=1e-3)
    assert [n for n, p in layer.named_parameters()] == ["bias"]          # filters are frozen


def test_ghost_batch_norm_equals_batch_norm_on_each_sub_batch():
    torch.manual_seed(0)
    bn = BatchNorm(6, NormConfig(ghost_batch=8, momentum=0.3))
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    x = torch.randn(32, 6, 5, 5) * 3 + 1
    y = bn(x)
    for i, chunk in enumerate(x.split(8)):
        ref = F.batch_norm(chunk, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
        assert torch.allclose(y[8 * i:8 * i + 8], ref, atol=1e-5)
    # running statistics move toward the mean of the sub-batches' statistics
    means = torch.stack([c.mean((0, 2, 3)) for c in x.split(8)]).mean(0)
    vars_ = torch.stack([c.var((0, 2, 3), unbiased=True) for c in x.split(8)]).mean(0)
    assert torch.allclose(bn.running_mean, 0.3 * means, atol=1e-5)
    assert torch.allclose(bn.running_var, 0.7 + 0.3 * vars_, atol=1e-5)
    # and it is not plain batch norm over the whole batch
    whole = F.batch_norm(x, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
    assert not torch.allclose(y, whole, atol=1e-3)
    bn.eval()
    assert torch.allclose(bn(x), F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                              training=False, eps=bn.eps))


def test_frozen_scale_is_not_trained_and_fp32_norm_keeps_input_dtype():
    bn = BatchNorm(4, NormConfig(scale="frozen", fp32=True))
    assert not bn.weight.requires_grad and bn.bias.requires_grad
    x = torch.randn(16, 4, 3, 3).bfloat16()
    y = bn(x)
    assert y.dtype == torch.bfloat16
    ref = F.batch_norm(x.float(), None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
    assert torch.allclose(y.float(), ref, atol=2e-2)


def test_auto_norm_precision_reads_bf16_on_a_cpu_and_fp32_on_cuda():
    from speedrun.models.norm import norm_in_fp32
    assert [norm_in_fp32("auto", d) for d in ("cpu", "cuda")] == [False, True]
    assert [norm_in_fp32(v, d) for v in (True, False) for d in ("cpu", "cuda")] == [True, True, False, False]
    x = torch.randn(16, 4, 5, 5).bfloat16()
    outs = {}
    for setting in ("auto", False, True):
        torch.manual_seed(0)
        outs[setting] = BatchNorm(4, NormConfig(fp32=setting))(x)
    assert all(y.dtype == torch.bfloat16 for y in outs.values())
    assert torch.equal(outs["auto"], outs[False])          # on the CPU, auto = the bf16 kernel as it is
    assert NormConfig().fp32 == "auto"


def _speednet(**kw):
    base = dict(widths=[8, 16, 16], whiten={"kernel": 2})
    base.update(kw)
    return SpeedNetConfig(**base)


@pytest.mark.parametrize("channels,size", [(3, 32), (1, 28), (3, 64)])
def test_speednet_takes_any_input_size_and_class_count(channels, size):
    net = build_model(_speednet(), channels, 7)
    assert net(torch.randn(4, channels, size, size)).shape == (4, 7)


def test_speednet_pools_before_the_activation_and_adds_residual_branches():
    cfg = _speednet(convs=[1, 1, 1], residual=[True, False, True], activation="celu", stem_width=12)
    net = build_model(cfg, 3, 10)
    block = net.features[-3]
    kinds = [type(m).__name__ for m in block[0]]
    assert kinds == ["Conv", "MaxPool2d", "BatchNorm", "CELU"]
    assert type(block[1]).__name__ == "Residual"
    assert type(net.features[-2][-1]).__name__ != "Residual"


def test_identity_init_passes_inputs_through():
    net = build_model(_speednet(identity_init=True, whiten={"kernel": 0}), 3, 10)
    conv = net.features[0][0][0]                           # 3 -> 8 channels
    x = torch.randn(2, 3, 6, 6)
    assert torch.allclose(conv(x)[:, :3], x, atol=1e-6)
    plain = build_model(_speednet(whiten={"kernel": 0}), 3, 10).features[0][0][0]
    assert not torch.allclose(plain(x)[:, :3], x, atol=1e-2)


def test_cifar10_94_network_layout():
    net = build_model(load_recipe("cifar10-94").model, 3, 10)
    assert net.whiten.out_channels == 24
    n = sum(p.numel() for p in net.parameters())
    # airbench94's net: 24 whiten bias + convs 24*64*9 + 64*64*9 + 64*256*9 + 3*256*256*9
    # + BN biases (64*2 + 256*4) + frozen BN weights (same count) + linear 256*10
    convs = 9 * (24 * 64 + 64 * 64 + 64 * 256 + 3 * 256 * 256)
    assert n == 24 + convs + 2 * (2 * 64 + 4 * 256) + 2560


def test_preact_resnet18_parameter_count():
    net = build_model(ResNetConfig(depth=18, preact=True, stem="cifar"), 3, 10)
    n = sum(p.numel() for p in net.parameters())
    # Kuang Liu's PreActResNet18 has 11,171,146 parameters; ours adds the final BN (2 * 512)
    assert n == 11_171_146 + 1024
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    post = build_model(ResNetConfig(depth=18, preact=False, stem="cifar"), 3, 10)
    assert post(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("name", ["page-resnet9", "dawnbench-resnet18", "cifar10-94", "cifar10-94-fast"])
def test_cifar_recipe_models_train_a_step_on_real_images(name, cifar10):
    from speedrun.optim import build_optimizer
    r = load_recipe(name)
    torch.manual_seed(0)
    net = build_model(r.model, 3, 10)
    x = (cifar10.train_x[:64].float() - 120) / 64
    if getattr(net, "whiten", None) is not None:
        net.whiten.fit(x)
    opt = build_optimizer(net, r.optim, r.data.batch_size)
    before = [p.detach().clone() for p in net.parameters()]
    loss = F.cross_entropy(net(x), cifar10.train_y[:64], label_smoothing=r.train.label_smoothing)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
