"""Is there a V building block that repeats every Γ = T_F + T_I + T_W within a held bound? An exact search
(issue 39, "V-Min"; tried, not kept in the library): docs/schedules.md, "An exact search for V-Min's block".

One microbatch's 6K actions on the V (K ranks, 2K half-stage chunks: a chunk's F, I, W take f = T_F/2,
i = T_I/2, w = T_W/2), each at a start on an integer grid (give the times as integers), repeated every
G = 2(f + i + w): a rank then has no idle time in the steady state, and the step tends to Γ a microbatch.
Depth first along the V (F down and back up, then I's), each action at every start from when its input is
ready up to one period later (later only lengthens lifespans) that overlaps nothing on its rank modulo G and
leaves room for the rank's remaining actions (they must tile the period exactly); when a rank's last I is
placed, its two W's go in what is left, each at the first occurrence after its I, and the rank's peak held
(F until W, a chunk counting 1/2) is checked exactly. Pruned by Little's law: a rank holds on average its
two stages' lifespans over G, and its peak is at least that. A block found is built into a Schedule and
simulated (``modelpar.simulate``), beside 1F1B, to check its peak and step.

    python benchmarks/search_v_blocks.py 1:1:1 4,8          # equal times: found at once
    python benchmarks/search_v_blocks.py 5:6:4 4             # 1:1.2:0.8 within V-Min's bound: exhaustive, none
    python benchmarks/search_v_blocks.py 5:6:4 4 --held 3    # within V-Half's bound: found at once
    python benchmarks/search_v_blocks.py 5:6:4 6,8 --nodes 300000
    python benchmarks/search_v_blocks.py 5:6:4 6 --held 4 --lds 10   # a limited discrepancy search
"""

from __future__ import annotations

import argparse
import math
import time

from modelpar.schedules import get_schedule
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.memory import peak_held
from modelpar.schedules.schedule import Schedule, v_map
from modelpar.simulate import Costs, simulate

Start = dict[tuple[int, str], int]


def _fits(used: list[tuple[int, int]], x: int, n: int, g: int) -> bool:
    x %= g
    return all(min(x + n, s + m + k * g) - max(x, s + k * g) <= 0 for s, m in used for k in (-1, 0, 1))


def _free(used: list[tuple[int, int]], g: int) -> list[tuple[int, int]]:
    """The free intervals (start mod g, length) of a rank's circle."""
    if not used:
        return [(0, g)]
    iv = sorted(used)
    out = []
    for k, (s, n) in enumerate(iv):
        nxt = iv[(k + 1) % len(iv)][0] + (g if k == len(iv) - 1 else 0)
        if nxt > s + n:
            out.append(((s + n) % g, nxt - s - n))
    return out


def _packable(caps: list[int], items: list[int]) -> bool:
    items = sorted(items, reverse=True)

    def rec(k: int) -> bool:
        if k == len(items):
            return True
        tried = set()
        for j, c in enumerate(caps):
            if c >= items[k] and c not in tried:
                tried.add(c)
                caps[j] -= items[k]
                if rec(k + 1):
                    return True
                caps[j] += items[k]
        return False

    return rec(0)


def search(k: int, f: int, i: int, w: int, held: int, nodes: int, lds: int | None = None,
           ) -> tuple[Start | None, int, bool]:
    """(a block's start times or None, nodes visited, whether the search was exhaustive). ``lds``: at most that
    many discrepancies (taking an action's c-th fitting start costs c): a limited discrepancy search."""
    stages, g, cap = 2 * k, 2 * (f + i + w), 2 * held  # cap: chunks
    rank = [s if s < k else stages - 1 - s for s in range(stages)]
    chain = [(s, "F") for s in range(stages)] + [(s, "I") for s in reversed(range(stages))]
    length = {"F": f, "I": i}
    rest = [0] * (len(chain) + 1)  # the chain's least time from position p to its end
    for p in reversed(range(len(chain))):
        rest[p] = rest[p + 1] + length[chain[p][1]]
    where = {a: p for p, a in enumerate(chain)}
    used: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    left = [[f, f, i, i, w, w] for _ in range(k)]
    start: Start = {}
    count = [0]

    def life_bound(now: int, p: int, s: int) -> int:
        return now + rest[p] - rest[where[(s, "I")] + 1] + w - start[(s, "F")]

    def bound_ok(now: int, p: int) -> bool:
        for d in range(k):
            a, b = d, stages - 1 - d
            if (a, "F") not in start or p > where[(a, "I")]:
                continue
            la = life_bound(now, p, a)
            lb = life_bound(now, p, b) if (b, "F") in start and p <= where[(b, "I")] else (d + 1) * (f + i) + w
            if max(-(-(la + lb) // g), -(-la // g) + lb // g, la // g - (-lb // g)) > cap:
                return False
        return True

    def peak(d: int) -> int:
        return max(sum((t - start[(s, "F")]) // g - (t - start[(s, "W")] - w) // g for s in (d, stages - 1 - d))
                   for t in range(g))

    def ws(d: int) -> list[tuple[int, int, int, int]]:
        spots = [x % g for s0, n in _free(used[d], g) for x in range(s0, s0 + n - w + 1)]
        out = []
        for xa in spots:
            if _fits(used[d], xa, w, g):
                for xb in spots:
                    if _fits([*used[d], (xa, w)], xb, w, g):
                        ea, eb = start[(d, "I")] + i, start[(stages - 1 - d, "I")] + i
                        out.append((ea + (xa - ea) % g, eb + (xb - eb) % g, xa, xb))
        return out

    def dfs(p: int, now: int, budget: int) -> Start | None:
        count[0] += 1
        if count[0] > nodes:
            return None
        if p == len(chain):
            return dict(start)
        s, kind = chain[p]
        d, n = rank[s], length[kind]
        c = -1
        for x in range(now, now + (g if p else 1)):  # the first action at 0: shifting a whole block changes nothing
            if not _fits(used[d], x, n, g):
                continue
            c += 1
            if c > budget:
                break
            used[d].append((x % g, n))
            left[d].remove(n)
            start[(s, kind)] = x
            if _packable([q for _, q in _free(used[d], g)], left[d]) and bound_ok(x + n, p + 1):
                if kind == "I" and s == d:  # the rank's last I: its W's, and its peak
                    for ta, tb, xa, xb in ws(d):
                        start[(d, "W")], start[(stages - 1 - d, "W")] = ta, tb
                        used[d] += [(xa, w), (xb, w)]
                        found = dfs(p + 1, x + n, budget - c) if peak(d) <= cap else None
                        del used[d][-2:]
                        if found:
                            return found
                    start.pop((d, "W"), None)
                    start.pop((stages - 1 - d, "W"), None)
                elif found := dfs(p + 1, x + n, budget - c):
                    return found
            del start[(s, kind)]
            left[d].append(n)
            used[d].pop()
        return None

    found = dfs(0, 0, nodes if lds is None else lds)
    return found, count[0], count[0] <= nodes and lds is None


def schedule(k: int, start: Start, g: int, m: int) -> Schedule:
    """The block repeated every g for m microbatches, each rank's actions in time order."""
    dev = v_map(k)
    per: list[list[tuple[int, Action]]] = [[] for _ in range(k)]
    for (s, kind), t0 in start.items():
        per[dev[s]] += [(t0 + j * g, Action(s, Kind[kind], j)) for j in range(m)]
    return Schedule(dev, tuple(tuple(a for _, a in sorted(p)) for p in per), "block")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("times", help="f:i:w, integers: a chunk's F, I, W (1:1.2:0.8 is 5:6:4)")
    ap.add_argument("ranks", help="K, comma separated")
    ap.add_argument("--held", type=int, default=0, help="the bound (default V-Min's, ⌈(K+2)/3⌉)")
    ap.add_argument("--nodes", type=int, default=200_000, help="give up after this many")
    ap.add_argument("--lds", type=int, default=None, help="limited discrepancy search: 0, 1, ... up to this many")
    args = ap.parse_args()
    f, i, w = (int(x) for x in args.times.split(":"))
    costs = Costs(forward=1.0, backward=(i + w) / f, weight=w / f)  # whole-stage times, T_F = 1
    for k in (int(x) for x in args.ranks.split(",")):
        held = args.held or math.ceil((k + 2) / 3)
        t0 = time.perf_counter()
        for lds in ([None] if args.lds is None else range(args.lds + 1)):
            found, visited, complete = search(k, f, i, w, held, args.nodes, lds)
            if found:
                break
        took = time.perf_counter() - t0
        tried = "" if args.lds is None else f", discrepancies <= {lds}"
        head = f"K = {k}, held <= {held}{tried}: {visited:,} nodes, {took:.1f} s"
        if found is None:
            why = " (exhaustive)" if complete else " (gave up)" if visited > args.nodes else ""
            print(f"{head}: none{why}")
            continue
        for m in (2 * k, 4 * k):
            tl = simulate(schedule(k, found, 2 * (f + i + w), m), costs)
            one = simulate(get_schedule("1f1b", ranks=k, microbatches=m), costs)
            peak = max(peak_held(schedule(k, found, 2 * (f + i + w), m).actions, 2))
            print(f"{head}: found; M = {m}: step {tl.step_time:.4g} (1F1B {one.step_time:.4g}), peak {peak:g}")


if __name__ == "__main__":
    main()
