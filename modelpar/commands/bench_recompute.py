"""``modelpar bench recompute``: the recomputation strategies side by side on this machine (§4.3).

For a chain of tanh layers (the reference's) or of MLP blocks: activations held at peak
(measured with saved-tensor hooks), extra layer forwards, whether the gradients are bitwise those
of "none" (no recomputation), and the median forward + backward time.
"""

from __future__ import annotations

import argparse

from modelpar.recompute.strategies import Strategy, parse_strategy


def parse_strategies(text: str) -> list[Strategy]:
    """``"none,4,sqrt,full"`` -> ``["none", 4, "sqrt", "full"]`` (each name checked by ``parse_strategy``)."""
    items = [parse_strategy(item) for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--strategies must list at least one strategy, got {text!r}")
    return items


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recompute", help="recomputation strategies: held activations, re-runs, time (section 4.3)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64, help="chain length n (default 64)")
    parser.add_argument("--layer", choices=("tanh", "mlp"), default="tanh",
                        help="tanh: the reference's chain; mlp: LayerNorm-Linear-GELU-Linear blocks (default tanh)")
    parser.add_argument("--width", type=int, default=32, help="features per row (default 32)")
    parser.add_argument("--rows", type=int, default=16, help="rows in the batch (default 16)")
    parser.add_argument("--strategies", default="none,2,4,8,16,sqrt,full,recompute-all",
                        help="comma-separated: none, k, sqrt, full, recompute-all (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per strategy, median shown (default 5)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from modelpar._validate import check_int
    from modelpar.recompute.chain_measure import strategy_table
    from modelpar.recompute.strategies import plan_recompute

    n = check_int("--layers", args.layers, minimum=1)
    width, rows = check_int("--width", args.width, minimum=1), check_int("--rows", args.rows, minimum=1)
    repeats = check_int("--repeats", args.repeats, minimum=0)
    strategies = parse_strategies(args.strategies)
    for strategy in strategies:
        plan_recompute(n, strategy)  # bad names and k out of range fail here, before any work
    torch.manual_seed(0)
    if args.layer == "tanh":
        layers: list = [torch.tanh] * n
    else:
        layers = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                  for _ in range(n)]
    x = torch.randn(rows, width, requires_grad=True)
    print(f"{n} {args.layer} layers, {rows} x {width} float32, torch {torch.__version__}")
    print(strategy_table(layers, x, strategies, repeats=repeats, model=args.layer == "tanh"))
    return 0
