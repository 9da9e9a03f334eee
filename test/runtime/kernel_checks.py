"""Comparisons for the kernel tests whose failure messages say what differs and by how much (the GPU runs are batched
on a remote machine: a failure has to be read from the log alone)."""
from __future__ import annotations

import pytest
import torch


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where got and want differ most, and how many elements of got are not finite."""
    diff = (got.double() - want.double()).abs().nan_to_num(float("inf"))
    worst = int(diff.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape)) if got.dim() else ()
    bad = int((~torch.isfinite(got)).sum())
    return (f"max |diff| {float(diff.max()):.3g} at {index} (got {float(got.flatten()[worst]):.6g}, want "
            f"{float(want.flatten()[worst]):.6g}); {bad} non-finite of {got.numel()}; shape {tuple(got.shape)} "
            f"{got.dtype}")


def assert_within(what: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> float:
    """rel(got, want) <= tolerance; returns the error."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    error = rel(got, want)
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:.3g}; {describe(got, want)}"
    return error


def assert_same_bytes(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """got and want are identical (shape, dtype, every element)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    if not torch.equal(got, want):
        differ = int((got != want).sum())
        pytest.fail(f"{what}: {differ} of {got.numel()} elements differ; {describe(got, want)}")
