"""GPTQ weight rounding: same grid and scales as nearest rounding, smaller error in the layer's output."""

from __future__ import annotations

import pytest
import torch

from pipeline.calibrate.rounding import (DEFAULT_DAMP, HessianStats, fp8_codes, gptq_inverse, int8_codes,
                                         round_weight)


def correlated_inputs(tokens: int, features: int, seed: int = 0) -> torch.Tensor:
    """Activations with correlated channels and a few outlier channels, like a transformer's; `seed`
    draws other tokens from the same distribution."""
    mix = torch.randn(features, features, generator=torch.Generator().manual_seed(100)) / features ** 0.5
    x = torch.randn(tokens, features, generator=torch.Generator().manual_seed(seed)) @ (mix + torch.eye(features))
    x[:, :3] *= 20.0
    return x


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float((x @ (w - q).T).pow(2).mean())


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_gptq_keeps_the_grid_and_cuts_the_output_error(fmt):
    x = correlated_inputs(4096, 96)
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    if fmt == "fp8":
        scale, codes = torch.tensor([float(w.abs().max()) / 448]), fp8_codes
    else:
        scale, codes = w.abs().amax(dim=1) / 127, int8_codes
    stats = HessianStats()
    for part in x.split(1000):                      # streamed in batches, like calibration
        stats.collect(part)
    assert stats.tokens == 4096
    hessian = stats.finish()
    assert hessian is stats.sum                      # the mean replaces the running sum: no second copy
    assert torch.allclose(hessian, x.T @ x / 4096, rtol=1e-4, atol=1e-3)

    nearest = round_weight(w, scale, codes, None)
    gptq = round_weight(w, scale, codes, gptq_inverse(hessian, damp=0.01))
    for c in (nearest, gptq):
        assert torch.equal(codes(c), c)             # every value is on the format's grid
    if fmt == "fp8":
        assert torch.equal(nearest, w.div(scale).to(torch.float8_e4m3fn).float())
        assert torch.equal(gptq.to(torch.float8_e4m3fn).float(), gptq)
    else:
        assert nearest.abs().max() <= 128 and gptq.min() >= -128 and gptq.max() <= 127
    s = scale.reshape(-1, 1)
    assert torch.equal(gptq[:, 0], nearest[:, 0])   # the first column has no error to absorb yet
    assert not torch.equal(gptq, nearest)
    held_out = correlated_inputs(4096, 96, seed=7)   # same distribution, other tokens
    err_nearest, err_gptq = output_error(held_out, w, nearest * s), output_error(held_out, w, gptq * s)
    assert err_gptq < 0.5 * err_nearest, (err_gptq, err_nearest)
    # more damping trusts the statistics less: between GPTQ and nearest (measured 0.78 x nearest)
    damped = output_error(held_out, w, round_weight(w, scale, codes, gptq_inverse(hessian, damp=DEFAULT_DAMP)) * s)
    assert err_gptq < damped < 0.9 * err_nearest


def test_inputs_that_never_fire_are_rounded_to_nearest_not_dropped():
    x = correlated_inputs(512, 32)
    x[:, 5] = 0.0
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    scale = w.abs().amax(dim=1) / 127
    q = round_weight(w, scale, int8_codes, gptq_inverse(x.T @ x / 512))
    assert torch.equal(q[:, 5], int8_codes(w[:, 5] / scale))


def test_rank_deficient_statistics_are_damped_and_broken_ones_fall_back_to_nearest():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    scale = w.abs().amax(dim=1) / 127
    nearest = round_weight(w, scale, int8_codes, None)
    few = correlated_inputs(4, 32)                    # 4 tokens, 32 features: H has rank 4
    q = round_weight(w, scale, int8_codes, gptq_inverse(few.T @ few / 4))
    assert torch.isfinite(q).all() and not torch.equal(q, nearest)
    indefinite = torch.eye(32)
    indefinite[0, 1] = indefinite[1, 0] = 2.0          # eigenvalue -1: needs 10x the damping
    q = round_weight(w, scale, int8_codes, gptq_inverse(indefinite))
    assert torch.isfinite(q).all() and not torch.equal(q, nearest)
    broken = torch.full((32, 32), float("nan"))
    assert gptq_inverse(broken) is None
    assert torch.equal(round_weight(w, scale, int8_codes, gptq_inverse(broken)), nearest)
