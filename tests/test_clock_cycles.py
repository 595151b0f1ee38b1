import pytest

from modelpar.schedules import clock_cycles


def test_reference_example_3_3():
    assert list(clock_cycles(stages=3, microbatches=3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]


def test_exercise_2_3():
    assert list(clock_cycles(stages=3, microbatches=2)) == [[(0, 0)], [(1, 0), (0, 1)], [(1, 1), (0, 2)], [(1, 2)]]


@pytest.mark.parametrize("m,k", [(1, 1), (1, 4), (5, 1), (4, 7), (9, 3)])
def test_every_pair_once_in_wave_i_plus_j(m, k):
    waves = list(clock_cycles(stages=k, microbatches=m))
    assert len(waves) == m + k - 1
    seen = [(i, j) for wave in waves for (i, j) in wave]
    assert sorted(seen) == sorted((i, j) for i in range(m) for j in range(k))
    for w, wave in enumerate(waves):
        assert all(i + j == w for i, j in wave)
        assert [j for _, j in wave] == sorted(j for _, j in wave)


def test_zero_microbatches_yields_nothing():
    assert list(clock_cycles(stages=4, microbatches=0)) == []


@pytest.mark.parametrize("m,k,arg", [(-1, 3, "microbatches"), (2, 0, "stages")])
def test_bad_arguments_raise_on_first_iteration(m, k, arg):
    gen = clock_cycles(stages=k, microbatches=m)  # no error yet: it is a generator
    with pytest.raises(ValueError, match=arg):
        next(gen)
