"""GPipe with recomputation (reference §4.3, GPipe §2.3): the memory model, and measured on a pipeline."""

from __future__ import annotations

import pytest
import torch

from modelpar.bench import measure_gpipe
from modelpar.recompute import gpipe_activation_memory, scaled_tanh_stages

N, L, K, WIDTH = 256, 48, 4, 4  # the reference's batch, layers and stages; a narrow layer keeps it fast


def test_reference_saving_8_7x_at_32_microbatches():
    plain = gpipe_activation_memory(N, L, K, 32, recompute=False)
    ours = gpipe_activation_memory(N, L, K, 32, recompute=True)
    assert (plain, ours) == (256 * 12, 256 + 12 * 8) == (3072, 352)
    assert round(plain / ours, 1) == 8.7


def test_one_microbatch_recompute_holds_slightly_more():
    plain = gpipe_activation_memory(N, L, K, 1, recompute=False)
    ours = gpipe_activation_memory(N, L, K, 1, recompute=True)
    assert ours == plain + N == 3328 and 1 < ours / plain < 1.1


def test_model_is_n_times_l_over_k_without_recompute_for_any_m():
    assert {gpipe_activation_memory(N, L, K, m, recompute=False) for m in (1, 2, 8, 64, 256)} == {N * L // K}
    savings = [gpipe_activation_memory(N, L, K, m, False) / gpipe_activation_memory(N, L, K, m, True) for m in (1, 2, 8, 32, 256)]
    assert savings == sorted(savings) and savings[-1] < L // K  # more micro-batches, more saving, never past L/K


@pytest.fixture(scope="module")
def measured() -> dict[tuple[int, bool], object]:
    """One GPipe step per (M, recompute) on 4 stages of 12 ScaledTanh layers, batch 256."""
    x = torch.randn(N, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return {(m, r): measure_gpipe(scaled_tanh_stages(L, K, WIDTH, "full" if r else None), x, m)
            for m in (1, 8, 32) for r in (False, True)}


@pytest.mark.parametrize("microbatches", [1, 8, 32])
@pytest.mark.parametrize("recompute", [False, True])
def test_measured_peak_per_stage_equals_model(measured, microbatches, recompute):
    report = measured[(microbatches, recompute)]
    expected = gpipe_activation_memory(N, L, K, microbatches, recompute)
    assert report.sample_layers(WIDTH) == [expected] * K
    tensors = microbatches + L // K if recompute else microbatches * L // K  # M stage inputs + one re-run
    assert [peak.count for peak in report.peaks] == [tensors] * K


def test_measured_saving_and_gradients(measured):
    plain, ours = measured[(32, False)], measured[(32, True)]
    assert round(plain.peaks[0].bytes / ours.peaks[0].bytes, 1) == 8.7
    assert measured[(1, True)].peaks[0].bytes > measured[(1, False)].peaks[0].bytes
    for m in (1, 8, 32):  # the re-run changes nothing: gradients bitwise equal
        assert all(torch.equal(a, b) for a, b in zip(measured[(m, False)].grads, measured[(m, True)].grads))
        assert len(measured[(m, True)].grads) == L


def test_bad_pipeline_shapes():
    with pytest.raises(ValueError, match=r"layers \(48\) must be divisible by stages \(5\)"):
        gpipe_activation_memory(N, L, 5, 32, True)
    with pytest.raises(ValueError, match=r"batch \(256\) must be divisible by microbatches \(3\)"):
        gpipe_activation_memory(N, L, K, 3, True)
    with pytest.raises(ValueError, match=r"microbatches must be >= 1, got 0"):
        measure_gpipe(scaled_tanh_stages(4, 2, 2, None), torch.ones(4, 2), 0)
