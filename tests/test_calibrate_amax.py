"""amax algorithms and streaming histograms, checked against nvidia-modelopt 0.37 as the oracle."""

import warnings

import numpy as np
import pytest
import torch

from pipeline.calibrate.amax import (Histogram, compute_amax, entropy_threshold_bin, mse_amax,
                                     percentile_amax)
from pipeline.calibrate.formats import FP8, INT8, e4m3_magnitudes
from pipeline.calibrate.histogram import StreamingHistogram

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from modelopt.torch.quantization.calib.histogram import (HistogramCalibrator, _compute_amax_entropy,
                                                             _compute_amax_percentile)


def heavy_tailed(seed: int, n: int = 60_000, dof: float = 3.0, scale: float = 1.0) -> np.ndarray:
    return np.abs(np.random.default_rng(seed).standard_t(dof, size=n)) * scale


def histogram_cases():
    """Histograms shaped like activations: heavy tails, holes, empty tails, a spike, grown bin counts."""
    cases = []
    for seed, bins in [(0, 2048), (1, 2048), (2, 2300), (3, 3000)]:
        x = heavy_tailed(seed, dof=2.5 + seed)
        counts, edges = np.histogram(x, bins=bins, range=(0, x.max()))
        cases.append((f"t{seed}-{bins}", counts, edges))
    x = heavy_tailed(7)
    counts, edges = np.histogram(x, bins=2048, range=(0, x.max()))
    holed = counts.copy()
    holed[900:1400] = 0
    cases.append(("holes", holed, edges))
    trailing = counts.copy()
    trailing[-40:] = 0
    cases.append(("empty-tail", trailing, edges))
    spiky = counts.copy()
    spiky[3] += 10_000_000
    cases.append(("spike", spiky, edges))
    return cases


@pytest.mark.parametrize("name,counts,edges", histogram_cases(), ids=[c[0] for c in histogram_cases()])
def test_entropy_picks_the_same_bin_as_modelopt(name, counts, edges):
    expected = float(_compute_amax_entropy(counts.copy(), edges, 8, False))
    chosen = entropy_threshold_bin(counts, INT8)
    assert np.float32(edges[chosen]) == np.float32(expected)


def test_entropy_ties_keep_the_last_minimum_like_modelopt():
    # A histogram whose mass ends well before its last bin: many candidates tie exactly.
    counts = np.zeros(2048, dtype=np.int64)
    counts[:100] = np.arange(100, 0, -1) * 50
    edges = np.linspace(0, 1, 2049)
    expected = float(_compute_amax_entropy(counts.copy(), edges, 8, False))
    assert np.float32(edges[entropy_threshold_bin(counts, INT8)]) == np.float32(expected)


def test_unsigned_style_levels_change_the_choice():
    """The level count matters: 128 INT8 levels and the E4M3 grid pick different thresholds."""
    x = heavy_tailed(11)
    counts, _ = np.histogram(x, bins=2048, range=(0, x.max()))
    assert entropy_threshold_bin(counts, INT8) != entropy_threshold_bin(counts, FP8)


def test_same_data_through_both_collectors_gives_the_same_histogram_and_amax():
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((4096, 64)) * 0.7
    oracle = HistogramCalibrator(num_bits=8)
    oracle.collect(x)
    ours = StreamingHistogram()
    ours.collect(x)
    hist = ours.histogram()
    np.testing.assert_array_equal(hist.counts, oracle._calib_hist.numpy().astype(np.float64))
    np.testing.assert_allclose(hist.edges, oracle._calib_bin_edges.numpy(), rtol=1e-6)
    for method in ("entropy", "percentile"):
        expected = float(oracle.compute_amax(method))
        assert compute_amax(method, hist, ours.running_max, INT8) == pytest.approx(expected, rel=1e-6)


def test_histogram_grows_at_the_same_width_and_counts_everything():
    h = StreamingHistogram()
    h.collect(torch.linspace(-1.0, 1.0, 10_001))
    width = h.width
    h.collect(torch.tensor([3.0, -2.5, 0.5]))
    assert h.width == width
    assert len(h.counts) == int(np.ceil(3.0 / width))
    assert h.counts.sum() == 10_004
    assert h.running_max == 3.0
    assert h.counts[int(2.5 / width)] >= 1 and h.counts[-1] >= 1


def test_histogram_memory_is_bounded_by_merging_bins():
    h = StreamingHistogram(num_bins=2048, max_bins=4096)
    h.collect(torch.rand(50_000))
    for scale in (10.0, 100.0, 1000.0):
        h.collect(torch.rand(50_000) * scale)
    assert len(h.counts) <= 4096
    assert h.counts.sum() == 200_000
    assert h.top >= 1000.0 * 0.999


def test_zero_batches_before_the_first_signal_are_kept_as_zeros():
    h = StreamingHistogram()
    h.collect(torch.zeros(100))
    h.collect(torch.ones(10))
    assert h.counts.sum() == 110 and h.counts[0] == 100


def test_percentile_matches_modelopt():
    x = heavy_tailed(5)
    counts, edges = np.histogram(x, bins=2048, range=(0, x.max()))
    for p in (99.0, 99.9, 99.99):
        expected = float(_compute_amax_percentile(counts, edges, p))
        assert percentile_amax(Histogram(counts.astype(float), edges[1]), p) == pytest.approx(expected, rel=1e-6)


def int8_round_trip(values, amax):
    scale = 127.0 / amax
    return np.clip(np.round(values * scale), -127, 127) / scale


def e4m3_round_trip(values, amax):
    scaled = torch.from_numpy(np.clip(values * 448.0 / amax, -448, 448))
    return scaled.to(torch.float8_e4m3fn).double().numpy() * amax / 448.0


@pytest.mark.parametrize("fmt,round_trip", [(INT8, int8_round_trip), (FP8, e4m3_round_trip)], ids=["int8", "fp8"])
def test_mse_is_the_brute_force_minimum(fmt, round_trip):
    # modelopt 0.37's _compute_amax_mse cannot serve as the oracle on the CPU: its INT8 branch passes
    # num_bits where fake_tensor_quant expects `bias`, and its FP8 branch calls ScaledE4M3Function
    # without the `M` argument (TypeError). So check NVIDIA's definition with a plain loop.
    x = heavy_tailed(9)
    counts, edges = np.histogram(x, bins=2048, range=(0, x.max()))
    centers = (edges[1:] + edges[:-1]) / 2
    errors = [float(np.mean((round_trip(centers, amax) - centers) ** 2 * counts)) for amax in centers[128:]]
    expected = centers[128 + int(np.argmin(errors))]
    assert mse_amax(Histogram(counts.astype(float), edges[1]), fmt) == pytest.approx(expected, rel=1e-12)


def test_e4m3_grid_and_fake_quant():
    mags = e4m3_magnitudes()
    assert mags[0] == 0 and mags[-1] == 448 and len(mags) == 127 and mags[1] == 2.0 ** -9
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0])
    q = FP8.fake_quant(x, 2.0)                      # 2.0 maps to 448; beyond saturates
    assert q[2] == 2.0 and q[3] == 2.0 and q[4] == 2.0 and q[1] == 1.0
    assert torch.equal(INT8.fake_quant(torch.tensor([0.5, 1.0, -3.0]), 1.0),
                       torch.tensor([64 / 127, 1.0, -1.0]))


def test_max_method_and_empty_statistics():
    h = StreamingHistogram()
    h.collect(torch.tensor([0.25, -4.0]))
    assert compute_amax("max", h.histogram(), h.running_max, FP8) == 4.0
    empty = StreamingHistogram()
    empty.collect(torch.zeros(5))
    assert compute_amax("entropy", empty.histogram(), empty.running_max, FP8) == 0.0
