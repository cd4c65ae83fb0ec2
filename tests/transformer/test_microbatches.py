"""``culmen.transformer.microbatches`` (constant and ramp-up calculators) and ``transformer.utils.divide``."""

from __future__ import annotations

import pytest

from culmen.transformer.microbatches import (
    ConstantNumMicroBatches,
    NumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatches,
    build_num_microbatches_calculator,
)
from culmen.transformer.utils import DivisibilityError, divide, ensure_divisibility


def test_constant():
    calc = build_num_microbatches_calculator(0, None, 96, 3, 4)
    assert isinstance(calc, ConstantNumMicroBatches) and isinstance(calc, NumMicroBatchesCalculator)
    assert (calc.get(), calc.get_current_global_batch_size(), calc.micro_batch_size) == (8, 96, 3)
    calc.update(10**6, True)
    assert calc.get() == 8
    with pytest.raises(ValueError, match=r"global batch size \(10\).*micro batch size \(3\).*data parallel size \(1\)"):
        ConstantNumMicroBatches(10, 3, 1)
    with pytest.raises(AssertionError):  # Apex asserted: code catching AssertionError still works
        ConstantNumMicroBatches(10, 3, 1)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int, got 0"):
        ConstantNumMicroBatches(10, 0, 1)


def _expected_rampup(start, inc, samples, final, consumed):
    # Walk the schedule: the batch grows by `inc` at every multiple of samples/num_increments.
    n = (final - start) // inc
    if consumed > samples:
        return final
    size = start
    for k in range(1, n + 1):
        if consumed >= k * samples / n:
            size = start + k * inc
    return min(size, final)


@pytest.mark.parametrize("start,inc,samples,final,mbs,dp", [(4, 4, 100, 16, 2, 2), (3, 3, 37, 21, 3, 1),
                                                            (8, 8, 1000, 64, 1, 8)])
def test_rampup_schedule(start, inc, samples, final, mbs, dp):
    calc = build_num_microbatches_calculator(1, [start, inc, samples], final, mbs, dp)
    assert isinstance(calc, RampupBatchsizeNumMicroBatches)
    assert calc.get_current_global_batch_size() == start
    assert calc.get() == start // (mbs * dp)
    seen = set()
    for consumed in list(range(0, samples + 3)) + [samples * 5]:
        calc.update(consumed, consistency_check=False)
        want = _expected_rampup(start, inc, samples, final, consumed)
        assert calc.get_current_global_batch_size() == want, consumed
        assert calc.get() == want // (mbs * dp)
        seen.add(want)
    assert seen == set(range(start, final + 1, inc))


def test_rampup_errors_and_edges():
    with pytest.raises(ValueError, match=r"interval \(10\).*increment \(4\)"):
        RampupBatchsizeNumMicroBatches(6, 4, 100, 16, 1, 1)
    with pytest.raises(ValueError, match=r"start batch size \(32\) exceeds the global batch size \(16\)"):
        RampupBatchsizeNumMicroBatches(32, 4, 100, 16, 1, 1)
    with pytest.raises(ValueError, match="rampup_batch_size must be"):
        build_num_microbatches_calculator(0, [4, 4], 16, 1, 1)
    calc = RampupBatchsizeNumMicroBatches(2, 2, 10, 8, 4, 1)  # 2 and 6 are not multiples of 4
    calc.update(0, False)
    assert calc.get() == 0
    with pytest.raises(ValueError, match=r"current global batch size \(6\)"):
        calc.update(8, True)
    calc.update(11, True)
    assert calc.get() == 2
    # start == final: constant from the start (Apex divided by zero); no ramp-up samples: final at once.
    assert RampupBatchsizeNumMicroBatches(8, 4, 100, 8, 2, 2).get() == 2
    zero = RampupBatchsizeNumMicroBatches(4, 4, 0, 16, 2, 2)
    assert zero.get_current_global_batch_size() == 16 and zero.get() == 4


def test_divide():
    assert divide(12, 4) == 3
    ensure_divisibility(0, 5)
    with pytest.raises(ValueError, match="13 is not divisible by 4"):
        divide(13, 4)
    with pytest.raises(AssertionError):
        ensure_divisibility(7, 2)
    with pytest.raises(DivisibilityError, match="1 is not divisible by 0"):
        divide(1, 0)
