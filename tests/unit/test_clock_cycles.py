import pytest

from modelpar.schedules import clock_cycles

REFERENCE_3_3 = [
    [(0, 0)],
    [(1, 0), (0, 1)],
    [(2, 0), (1, 1), (0, 2)],
    [(2, 1), (1, 2)],
    [(2, 2)],
]


def test_reference_example_3_3_called_as_the_reference_writes_it():
    assert list(clock_cycles(3, 3)) == REFERENCE_3_3
    assert list(clock_cycles(num_batches=3, num_partitions=3)) == REFERENCE_3_3
    assert list(clock_cycles(stages=3, microbatches=3)) == REFERENCE_3_3


def test_hw5_pipe_call_form():
    # Pipe.forward in the reference: clock_cycles(len(batches), len(self.stages)); 4 micro-batches, 2 stages
    batches, stages = [0, 1, 2, 3], ["s0", "s1"]
    assert list(clock_cycles(len(batches), len(stages))) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(3, 0), (2, 1)], [(3, 1)],
    ]


def test_exercise_2_3():
    # the reference's exercise: clock_cycles(2, 3) is 2 micro-batches on 3 stages
    expected = [[(0, 0)], [(1, 0), (0, 1)], [(1, 1), (0, 2)], [(1, 2)]]
    assert list(clock_cycles(2, 3)) == expected
    assert list(clock_cycles(stages=3, microbatches=2)) == expected


@pytest.mark.parametrize("m,k", [(1, 1), (1, 4), (5, 1), (4, 7), (9, 3)])
def test_every_pair_once_in_wave_i_plus_j(m, k):
    waves = list(clock_cycles(m, k))
    assert len(waves) == m + k - 1
    seen = [(i, j) for wave in waves for (i, j) in wave]
    assert sorted(seen) == sorted((i, j) for i in range(m) for j in range(k))
    for w, wave in enumerate(waves):
        assert all(i + j == w for i, j in wave)
        assert [j for _, j in wave] == sorted(j for _, j in wave)


def test_zero_microbatches_yields_nothing():
    assert list(clock_cycles(0, 4)) == []
    assert list(clock_cycles(stages=4, microbatches=0)) == []


@pytest.mark.parametrize("m,k,arg", [(-1, 3, "num_batches"), (2, 0, "num_partitions")])
def test_bad_arguments_raise_on_first_iteration(m, k, arg):
    gen = clock_cycles(m, k)  # no error yet: it is a generator
    with pytest.raises(ValueError, match=arg):
        next(gen)


@pytest.mark.parametrize("kwargs", [dict(), dict(num_batches=3, microbatches=3, num_partitions=2)])
def test_each_count_given_exactly_once(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        next(clock_cycles(**kwargs))
