"""Weight gradients of 3x3 convolutions as nine matrix products, where that is faster (CPU, bf16).

The weight gradient of a stride-1, padding-1 3x3 convolution is, for each of its nine taps
(i, j), one matrix product: the output gradient as a (K, N*H*W) matrix times the input shifted
by (i, j) as a (N*H*W, C) matrix. On a 2-core Intel Xeon with AMX (6/167, torch 2.13.0)
oneDNN's bf16 backward-weights kernel (brgconv_bwd_w) is slow where the feature maps are small
and the batch large, the speed net's deep layers: for 2,000 images, 256 -> 256 channels, it took
94 ms at 3x3 px, 135 at 5x5 and 165 at 6x6, against 29, 79 and 120 ms as products, while at 7x7
and above oneDNN was the faster (``docs/history.md``); ResNet-18D's last stage at 128 px (64 images,
512 channels at 4x4 px) took 21.6 ms against 8.5. So which way a shape goes is measured,
not assumed: ``runtime.conv_weight_grad = "auto"`` times both on the real tensors the first time
a shape's backward runs (in the run's first steps) and keeps the products only where they took
at most :data:`MARGIN` of oneDNN's time; "gemm" takes them for every such convolution, "torch"
never. Only eager bf16 steps on a CPU take this path: elsewhere the convolution is torch's own.

The products accumulate in fp32 (chunks of images summed in fp32), as oneDNN's kernel does, and
the result is rounded to bf16 once; the two differ by rounding only (relative 2e-3 of the
gradient, against fp32 products, in the test).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

MODES = ("auto", "torch", "gemm")
MARGIN = 0.8
"""The products replace oneDNN for a shape only where they took at most this share of its time
(a clear win, so that timing noise does not flip the choice between processes)."""
CHUNK = 1000
"""Images per block of products: the shifted copies of a block stay in the caches."""

_mode = "torch"
_choices: dict[tuple, str] = {}


def set_mode(mode: str, forget: bool = True) -> None:
    """The process-wide choice (``Runtime.activate``): "auto", "torch" or "gemm". Each
    activation measures afresh (the shapes timed so far are forgotten, unless ``forget`` is
    False: a benchmark switching modes back and forth keeps them)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"conv_weight_grad mode {mode!r}: expected one of {MODES}")
    _mode = mode
    if forget:
        _choices.clear()


def mode() -> str:
    return _mode


def resolve(setting: str, device_type: str, precision: str, compiled: bool) -> str:
    """``runtime.conv_weight_grad`` as a run uses it: the products only exist for eager bf16
    steps on a CPU; anywhere else (CUDA, compiled, fp32: bit-exact resume stays with torch's
    kernels) it is "torch"."""
    if device_type != "cpu" or precision != "bf16" or compiled:
        return "torch"
    return setting


def choose(torch_seconds: float, gemm_seconds: float, margin: float = MARGIN) -> str:
    """"gemm" where the products took at most ``margin`` of torch's time, else "torch"."""
    return "gemm" if gemm_seconds <= margin * torch_seconds else "torch"


def measured() -> dict[tuple[tuple[int, int, int, int], int], str]:
    """The measured choice per shape in this process: ((N, C, H, W) of the input, K) -> "gemm"
    or "torch"."""
    return dict(sorted(_choices.items()))


def choices() -> dict[str, str]:
    """:func:`measured`, keyed "NxCxHxW->K" (the summary's form)."""
    return {f"{n}x{c}x{h}x{w}->{k}": how for ((n, c, h, w), k), how in measured().items()}


def _torch_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, input_grad: bool) -> torch.Tensor:
    """torch's (oneDNN's) gradient of the stride-1, padding-1 convolution: of its input, or else
    of its weight."""
    mask = [True, False, False] if input_grad else [False, True, False]
    return torch.ops.aten.convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                               mask)[0 if input_grad else 1]


def torch_weight_grad(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _torch_backward(g, x, w, input_grad=False)


def gemm_weight_grad(g: torch.Tensor, x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """dW (K, C, 3, 3) of a stride-1, padding-1 3x3 convolution of ``x`` (N, C, H, W) whose
    output gradient is ``g`` (N, K, H, W): nine shifted matrix products per block of images,
    summed in fp32, returned in ``x``'s dtype and in channels_last (the weights' layout)."""
    n, c, h, w = x.shape
    k = g.shape[1]
    padded = F.pad(x, (1, 1, 1, 1)).permute(0, 2, 3, 1)         # N, H+2, W+2, C
    total = torch.zeros(9, k, c, dtype=torch.float32, device=x.device)
    block = min(chunk, n)
    shifted = torch.empty(block * h * w, c, dtype=x.dtype, device=x.device)
    product = torch.empty(k, c, dtype=x.dtype, device=x.device)
    for start in range(0, n, block):
        m = min(block, n - start)
        grad = g[start:start + m].permute(1, 0, 2, 3).reshape(k, m * h * w)
        rows = shifted[:m * h * w]
        for tap in range(9):
            i, j = divmod(tap, 3)
            rows.view(m, h, w, c).copy_(padded[start:start + m, i:i + h, j:j + w, :])
            torch.mm(grad, rows, out=product)
            total[tap].add_(product)
    return total.view(3, 3, k, c).permute(2, 3, 0, 1).to(x.dtype).contiguous(memory_format=torch.channels_last)


def _timed(f) -> tuple[torch.Tensor, float]:
    t = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t


def _measure(g, x, w) -> tuple[str, torch.Tensor]:
    """Both ways, twice each (the first calls carry one-off costs); the choice and a gradient."""
    _timed(lambda: torch_weight_grad(g, x, w))
    _timed(lambda: gemm_weight_grad(g, x))
    theirs, t_torch = _timed(lambda: torch_weight_grad(g, x, w))
    ours, t_gemm = _timed(lambda: gemm_weight_grad(g, x))
    how = choose(t_torch, t_gemm)
    return how, ours if how == "gemm" else theirs


def _key(x: torch.Tensor, w: torch.Tensor) -> tuple:
    return tuple(x.shape), w.shape[0]


def weight_grad(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if _mode == "gemm":
        return gemm_weight_grad(g, x)
    key = _key(x, w)
    how = _choices.get(key)
    if how is None:
        how, grad = _measure(g, x, w)
        _choices[key] = how
        return grad
    return gemm_weight_grad(g, x) if how == "gemm" else torch_weight_grad(g, x, w)


class _Conv3x3(torch.autograd.Function):
    """A bias-free stride-1 3x3 convolution with padding 1 whose weight gradient is
    :func:`weight_grad` (the input gradient stays oneDNN's)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.conv2d(x, w, padding=1)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _torch_backward(g, x, w, input_grad=True)
        if ctx.needs_input_grad[1]:
            gw = weight_grad(g, x, w)
        return gx, gw


def takes(conv: torch.nn.Conv2d, x: torch.Tensor) -> bool:
    """Whether this call of ``conv`` goes the measured way: the mode allows it, a training
    forward on a CPU in bf16 (autocast or bf16 tensors) outside torch.compile, and a
    convolution of the one shape the products compute."""
    if _mode == "torch" or x.device.type != "cpu" or not torch.is_grad_enabled() or not conv.weight.requires_grad:
        return False
    if torch.compiler.is_compiling():
        return False
    bf16 = (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16) or \
        x.dtype == torch.bfloat16 == conv.weight.dtype
    if not bf16 or conv.bias is not None or conv.groups != 1:
        return False
    if conv.kernel_size != (3, 3) or conv.stride != (1, 1) or conv.dilation != (1, 1) or conv.padding != (1, 1):
        return False
    return _mode == "gemm" or _choices.get(_key(x, conv.weight)) != "torch"


def conv3x3(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` in bf16 through :class:`_Conv3x3` (call where :func:`takes` says so)."""
    w = conv.weight.to(torch.bfloat16)
    with torch.autocast("cpu", enabled=False):
        return _Conv3x3.apply(x.to(torch.bfloat16), w)


class Conv2d(torch.nn.Conv2d):
    """``nn.Conv2d`` whose training calls go through :func:`conv3x3` where :func:`takes` says so
    (the speed nets' and ResNets' convolutions)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes(self, x):
            return conv3x3(self, x)
        return super().forward(x)
