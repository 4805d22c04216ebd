"""Patch whitening: a first convolution whose frozen filters decorrelate the pixels of each
k x k patch, computed once from the training data's patch covariance (Page, 2018; airbench
uses 2x2 patches and each filter's negation).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def image_patches(images: torch.Tensor, kernel: int) -> torch.Tensor:
    """All k x k patches of a batch of images, flattened to rows of C*k*k values."""
    n, c, _, _ = images.shape
    p = images.unfold(2, kernel, 1).unfold(3, kernel, 1)          # N, C, H', W', k, k
    return p.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * kernel * kernel)


def whiten_patches(images: torch.Tensor, kernel: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Filters W (C*k*k, C, k, k) and bias b such that W*patch + b has zero mean and
    (for eps -> 0) identity covariance over the patches of ``images``.

    Filters are the covariance eigenvectors scaled by 1/sqrt(eigenvalue + eps), ordered from
    the largest eigenvalue down."""
    c = images.shape[1]
    d = c * kernel * kernel
    total = torch.zeros(d, dtype=torch.float64, device=images.device)
    moment = torch.zeros(d, d, dtype=torch.float64, device=images.device)
    count = 0
    for chunk in images.split(1024):          # float64 sums, in chunks to bound memory
        p = image_patches(chunk.double(), kernel)
        total += p.sum(dim=0)
        moment += p.T @ p
        count += p.shape[0]
    mean = total / count
    cov = moment / count - torch.outer(mean, mean)
    eigvals, eigvecs = torch.linalg.eigh(cov)                     # ascending
    eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
    filters = (eigvecs.T / torch.sqrt(eigvals.clamp_min(0) + eps)[:, None]).float()
    bias = -(filters @ mean.float())
    return filters.reshape(-1, c, kernel, kernel), bias


class PatchWhitening(nn.Module):
    """Frozen whitening filters (a buffer) with a trainable bias."""

    def __init__(self, in_channels: int, kernel: int, eps: float, negate: bool, padding: bool):
        super().__init__()
        n = in_channels * kernel * kernel
        self.kernel, self.eps, self.negate = kernel, eps, negate
        self.padding = "same" if padding else 0
        self.out_channels = 2 * n if negate else n
        self.register_buffer("weight", torch.zeros(self.out_channels, in_channels, kernel, kernel))
        self.bias = nn.Parameter(torch.zeros(self.out_channels))

    @torch.no_grad()
    def fit(self, images: torch.Tensor) -> None:
        w, b = whiten_patches(images, self.kernel, self.eps)
        if self.negate:
            w, b = torch.cat([w, -w]), torch.cat([b, -b])
        self.weight.copy_(w)
        self.bias.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, padding=self.padding)
