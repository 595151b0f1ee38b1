"""Bad mixture-of-experts input on the command line: one line, exit code 2, no rank started."""

import pytest
from test_errors_cli import TINY, no_ranks, one_line  # noqa: F401  (no_ranks is a fixture)

LLAMA = [*TINY, "--arch", "llama"]


@pytest.mark.parametrize(("args", "message"), [
    (["--experts", "6", "--dp", "4", "--ep", "4", "--batch-size", "8"], "experts (6) must be divisible by ep (4)"),
    (["--experts", "4", "--top-k", "5"], "top_k must be an integer from 1 to experts (4), got 5"),
    (["--experts", "4", "--arch", "gpt"], "experts (4) needs arch 'llama' (SwiGLU experts), got arch 'gpt'"),
    (["--experts", "4", "--capacity-factor", "0"], "capacity_factor must be > 0.0, got 0.0"),
    (["--experts", "4", "--capacity-factor", "-1.5"], "capacity_factor must be > 0.0, got -1.5"),
    (["--experts", "4", "--dp", "2", "--ep", "4", "--batch-size", "8"], "dp (2) must be divisible by ep (4)"),
    (["--dp", "2", "--ep", "2"], "ep (2) needs a mixture of experts (experts > 0), got experts 0"),
    (["--experts", "4", "--router", "relu"], "router must be one of"),
    (["--experts", "4", "--cp", "2"], "experts with cp > 1 is not supported"),
    (["--experts", "4", "--tp", "2", "--heads", "4", "--sequence-parallel"], "experts with sequence_parallel is not"),
])
def test_bad_moe_input_is_one_line(capsys, no_ranks, args, message):  # noqa: F811
    assert one_line(capsys, "train", [*LLAMA, *args]).startswith(message)
