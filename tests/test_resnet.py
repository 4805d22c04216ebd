import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from speedrun.models import build_model
from speedrun.models.norm import BatchNorm
from speedrun.models.resnet import BasicBlock, Bottleneck, round_up_to_multiple
from speedrun.recipe import NormConfig, ResNetConfig


def n_params(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def on_meta(cfg: ResNetConfig, num_classes: int = 1000) -> nn.Module:
    with torch.device("meta"):
        return build_model(cfg, 3, num_classes)


def residual_blocks(net: nn.Module) -> list[nn.Module]:
    return [b for stage in net.stages for b in stage]


@pytest.mark.parametrize("depth,variant,expected", [
    (18, "a", 11_689_512), (34, "a", 21_797_672), (50, "a", 25_557_032), (101, "a", 44_549_160),
    (50, "b", 25_557_032), (50, "c", 25_576_264), (50, "d", 25_576_264),
])
def test_imagenet_parameter_counts_match_the_published_ones(depth, variant, expected):
    assert n_params(on_meta(ResNetConfig(depth=depth, variant=variant, stem="imagenet"))) == expected


def test_preact_cifar_resnet18_keeps_the_dawnbench_parameter_count():
    net = on_meta(ResNetConfig(depth=18, stem="cifar", preact=True), num_classes=10)
    # Kuang Liu's PreActResNet18 has 11,171,146 parameters; ours adds the final BN (2 * 512)
    assert n_params(net) == 11_171_146 + 1024
    assert all(not isinstance(m, nn.MaxPool2d) for m in net.modules())


@pytest.mark.parametrize("depth,stem,variant,preact,size,classes", [
    (18, "imagenet", "a", False, 224, 1000), (50, "imagenet", "d", False, 224, 17),
    (18, "cifar", "a", True, 32, 10), (34, "cifar", "d", False, 32, 3), (101, "cifar", "b", False, 32, 5),
])
def test_output_shape_for_any_size_and_class_count(depth, stem, variant, preact, size, classes):
    cfg = ResNetConfig(depth=depth, stem=stem, variant=variant, preact=preact, width=8)
    net = build_model(cfg, 3, classes)
    assert net(torch.randn(2, 3, size, size)).shape == (2, classes)


def test_imagenet_stem_divides_the_resolution_by_4_and_cifar_stem_keeps_it():
    x = torch.randn(1, 3, 64, 64)
    for variant in ("a", "c"):
        stem = build_model(ResNetConfig(depth=18, variant=variant, width=8), 3, 10).stem
        assert stem(x).shape == (1, 8, 16, 16)
    stem = build_model(ResNetConfig(depth=18, stem="cifar", width=8), 3, 10).stem
    assert stem(x).shape == (1, 8, 64, 64)


def test_variant_c_stem_is_three_3x3_convs_with_batch_norm_and_relu():
    net = on_meta(ResNetConfig(depth=50, variant="c", width=64))
    convs = [m for m in net.stem if isinstance(m, nn.Conv2d)]
    assert [(c.kernel_size, c.stride, c.out_channels) for c in convs] == [
        ((3, 3), (2, 2), 32), ((3, 3), (1, 1), 32), ((3, 3), (1, 1), 64)]
    kinds = [type(m).__name__ for m in net.stem]
    assert kinds == ["Conv2d", "BatchNorm", "ReLU"] * 3 + ["MaxPool2d"]
    plain = on_meta(ResNetConfig(depth=50, variant="b"))
    assert [m.kernel_size for m in plain.stem if isinstance(m, nn.Conv2d)] == [(7, 7)]


def test_variant_b_strides_the_3x3_conv_of_each_down_sampling_bottleneck():
    for variant, strides in (("a", ((2, 2), (1, 1))), ("b", ((1, 1), (2, 2)))):
        net = on_meta(ResNetConfig(depth=50, variant=variant, width=8))
        for stage in net.stages[1:]:
            first = stage[0]
            assert (first.conv1.stride, first.conv2.stride) == strides
            assert first.conv3.stride == (1, 1)
        assert all(b.conv1.stride == b.conv2.stride == (1, 1) for s in net.stages for b in s[1:])
    x = torch.randn(2, 3, 32, 32)
    assert build_model(ResNetConfig(depth=50, variant="b", stem="cifar", width=8), 3, 4)(x).shape == (2, 4)


def test_variant_d_shortcut_average_pools_then_applies_a_stride_1_conv():
    net = build_model(ResNetConfig(depth=18, variant="d", stem="cifar", width=8), 3, 10)
    for stage in net.stages[1:]:
        pool, conv, bn = stage[0].shortcut
        assert isinstance(pool, nn.AvgPool2d) and pool.kernel_size == pool.stride == 2
        assert pool.ceil_mode and not pool.count_include_pad
        assert conv.kernel_size == (1, 1) and conv.stride == (1, 1) and isinstance(bn, BatchNorm)
    # ceil mode keeps the edge row/column of an odd-sized map, averaged over real pixels only
    shortcut = net.stages[1][0].shortcut.eval()
    _, conv, bn = shortcut
    x = torch.randn(1, 8, 7, 7)
    ref = bn(conv(F.avg_pool2d(x, 2, ceil_mode=True, count_include_pad=False)))
    assert torch.allclose(shortcut(x), ref) and ref.shape[-1] == 4
    # without D, the shortcut is a strided 1x1 conv
    conv_c = on_meta(ResNetConfig(depth=50, variant="c")).stages[1][0].shortcut[0]
    assert conv_c.kernel_size == (1, 1) and conv_c.stride == (2, 2)


@pytest.mark.parametrize("depth,variant", [(18, "a"), (50, "d")])
def test_zero_gamma_makes_every_block_start_as_identity_then_relu(depth, variant):
    torch.manual_seed(0)
    net = build_model(ResNetConfig(depth=depth, variant=variant, stem="cifar", width=8, zero_gamma=True), 3, 10)
    net.eval()
    blocks = residual_blocks(net)
    assert all(torch.all(b.last_norm.weight == 0) for b in blocks)
    x = net.stem(torch.randn(2, 3, 16, 16))
    with torch.no_grad():
        for block in blocks:
            y = block(x)
            assert torch.allclose(y, F.relu(block.shortcut(x)))
            x = y
    # the other BNs keep scale 1, and without zero_gamma the branches are not zero
    first = blocks[0]
    assert torch.all(first.bn1.weight == 1)
    plain = build_model(ResNetConfig(depth=depth, variant=variant, stem="cifar", width=8), 3, 10).eval()
    x = plain.stem(torch.randn(2, 3, 16, 16))
    with torch.no_grad():
        assert not torch.allclose(plain.stages[0][0](x), F.relu(plain.stages[0][0].shortcut(x)))


def test_zero_gamma_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="zero_gamma needs preact = false"):
        build_model(ResNetConfig(depth=18, preact=True, zero_gamma=True), 3, 10)
    with pytest.raises(ValueError, match="zero_gamma needs model.norm.scale"):
        build_model(ResNetConfig(depth=18, zero_gamma=True, norm=NormConfig(scale="frozen")), 3, 10)


def test_kaiming_and_xavier_init_give_their_weight_std():
    torch.manual_seed(0)
    for init in ("kaiming", "xavier"):
        net = build_model(ResNetConfig(depth=18, stem="cifar", width=16, init=init), 3, 10)
        conv = net.stages[3][1].conv1                          # 128 -> 128, 3x3
        fan = conv.in_channels * 9
        assert conv.out_channels * 9 == fan
        expected = math.sqrt(2 / fan) if init == "kaiming" else math.sqrt(2 / (fan + fan))
        assert conv.weight.std().item() == pytest.approx(expected, rel=0.02)
        if init == "xavier":
            assert conv.weight.abs().max() <= math.sqrt(6 / (fan + fan))
        bns = [m for m in net.modules() if isinstance(m, BatchNorm)]
        assert all(torch.all(b.weight == 1) and torch.all(b.bias == 0) for b in bns)
    # the head keeps torch's default: uniform within 1/sqrt(fan_in)
    assert net.head.weight.abs().max() <= 1 / math.sqrt(net.head.in_features)


def test_channel_counts_are_multiples_of_8_for_odd_widths():
    assert [round_up_to_multiple(x, 8) for x in (8, 9, 16, 20, 23, 24)] == [8, 16, 16, 24, 24, 24]
    for depth, variant in ((18, "a"), (50, "c")):
        net = build_model(ResNetConfig(depth=depth, variant=variant, width=20), 3, 10)
        convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
        assert all(c.in_channels % 8 == 0 or c.in_channels == 3 for c in convs)
        assert all(c.out_channels % 8 == 0 for c in convs)
        expansion = 4 if depth == 50 else 1
        assert [stage[0].conv1.out_channels for stage in net.stages] == [24, 40, 80, 160]
        assert net.head.in_features == 160 * expansion
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_block_kinds_follow_depth_and_preact():
    assert isinstance(on_meta(ResNetConfig(depth=34)).stages[0][0], BasicBlock)
    assert isinstance(on_meta(ResNetConfig(depth=101)).stages[0][0], Bottleneck)
    preact = on_meta(ResNetConfig(depth=34, preact=True)).stages[0][0]
    assert type(preact).__name__ == "PreActBlock"


# ------------------------------------------------------------------------------------------
# Anti-aliased down-sampling (model.antialias)
# ------------------------------------------------------------------------------------------

def test_blur_is_a_normalised_binomial_low_pass_then_subsampling():
    from speedrun.models.resnet import Blur
    flat = torch.full((1, 2, 8, 8), 3.0)
    assert torch.allclose(Blur(stride=2)(flat), torch.full((1, 2, 4, 4), 3.0))      # keeps a constant
    # the highest frequency (a checkerboard) is removed inside, where reflection does not reach
    board = (torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 2 * 2.0 - 1
    out = Blur()(board.expand(1, 1, 8, 8))
    assert out[..., 1:-1, 1:-1].abs().max() < 1e-6
    # a plain stride-2 subsampling keeps the checkerboard whole: it aliases to a constant
    assert board[::2, ::2].abs().min() == 1
    assert not any(True for _ in Blur().parameters()) and "kernel" not in Blur().state_dict()


@pytest.mark.parametrize("antialias", ["stem", "all"])
@pytest.mark.parametrize("depth,variant", [(18, "d"), (50, "b"), (18, "a")])
def test_antialiased_resnets_keep_shapes_parameters_and_initial_weights(antialias, depth, variant):
    """The blur adds no parameter and leaves the output shape, and the weights drawn from a seed
    are the same numbers as without it (only the names of the blurred convs move)."""
    plain_cfg = ResNetConfig(depth=depth, variant=variant, stem="imagenet", width=16)
    blurred_cfg = ResNetConfig(depth=depth, variant=variant, stem="imagenet", width=16, antialias=antialias)
    torch.manual_seed(0)
    plain = build_model(plain_cfg, 3, 10)
    torch.manual_seed(0)
    blurred = build_model(blurred_cfg, 3, 10)
    assert n_params(plain) == n_params(blurred)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), blurred.parameters()))
    x = torch.randn(2, 3, 64, 64)
    assert blurred(x).shape == plain(x).shape == (2, 10)
    n_blurs = sum(type(m).__name__ == "Blur" for m in blurred.modules())
    strided = sum(isinstance(m, nn.Conv2d) and m.stride == (2, 2) for m in plain.modules())
    assert n_blurs == (1 if antialias == "stem" else 1 + strided)


def test_antialiasing_is_refused_for_the_cifar_stem():
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="antialias"):
        ResNetConfig(stem="cifar", antialias="stem")
