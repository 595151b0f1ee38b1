"""Where a one-rank step goes: ``--validate-local``'s p = d = 1 runs, each part of the measured step beside the
prediction with the kernel composition (the model before profile version 2) and with the whole-work tables.

    modelpar calibrate --out hw.json --ranks 1
    python benchmarks/local_step_parts.py hw.json
    python benchmarks/local_step_parts.py hw.json --two-ranks   # d = 2 at ZeRO 0-3 and p = 2, rank 0

Measured (median of the steps after the first): the pipeline runtime's step, of it each F and B action (one
micro-batch through the embedding, the 4 layers, the head and the loss), and the trainer's step end: the
optimizer, the gradient norm and clipping, the batch, the stop agreement, the zeroing. Predicted: per F and
B, and the step end. Timing only: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

PARTS = {"batch": "data", "runner.step": "runner", "dp.sync.finish": "grad_finish", "dp.clipper.clip": "clip",
         "stop.agree": "agree", "optimizer.step": "optimizer", "dp.sync.zero_grad": "zero_grad"}
STEP_END = ("data", "grad_finish", "clip", "agree", "optimizer", "zero_grad")  # the parts outside the runner


def _rank(cfg: Any, steps: int) -> dict[str, float]:
    """Train ``cfg`` for ``steps`` with each part of ``_Run.step`` timed; the medians after the first step."""
    import torch

    import modelpar.training.loop as loop
    from modelpar.training import train
    from modelpar.training.start import rank_threads

    torch.set_num_threads(rank_threads(cfg.dims.world_size))
    parts: dict[str, list[float]] = {}
    build = loop._Run.__init__

    def timed(obj: Any, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            parts.setdefault(key, []).append(time.perf_counter() - t0)
            if key == "runner":
                for action, start, end in obj.record.events:
                    parts.setdefault(action.kind.name, []).append(end - start)
            return out

        setattr(obj, attr, wrapper)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        for path, key in PARTS.items():
            *owners, attr = path.split(".")
            obj = self
            for name in owners:
                obj = getattr(obj, name)
            timed(obj, attr, key)

    loop._Run.__init__ = init  # type: ignore[method-assign]
    result = train(dataclasses.replace(cfg, steps=steps))
    out = {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in parts.items()}
    out["step"] = statistics.median(result.step_times[1:])
    return out


def main() -> None:
    from modelpar.calibrate.validate_local import BASE, MODELS
    from modelpar.costmodel.local_compute import end_seconds, kernel_ends, kernel_layer, layer_seconds, runtime_seconds
    from modelpar.costmodel.profiles import load_profile
    from modelpar.distributed import LocalCluster
    from modelpar.training.prediction import local_run, predict_run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--two-ranks", action="store_true",
                        help="h128, m = 4 on two ranks instead: d = 2 at ZeRO 0-3 and p = 2, rank 0's parts")
    args = parser.parse_args()
    hw = load_profile(args.profile)
    if args.two_ranks:
        _two_ranks(hw, args.steps)
        return
    kernels = dataclasses.replace(hw, layer={}, ends={}, blockwise={}, runtime_s={}, optimizer={})
    ms = lambda x: f"{1e3 * x:6.2f}"  # noqa: E731
    with LocalCluster(1, timeout=300.0, run_timeout=None) as cluster:
        for name in MODELS:
            for m in (2, 4):
                for recompute in ("none", "full"):
                    cfg = dataclasses.replace(BASE, model=MODELS[name], microbatches=m, recompute=recompute, tp=1,
                                              pp=1, dp=1).check(1)
                    got = cluster.run(_rank, cfg, args.steps)[0]
                    run, full = local_run(cfg), recompute == "full"
                    layer, _ = kernel_layer(run, kernels)
                    embed, head = kernel_ends(run, kernels, 0)
                    kf = run.model.layers * layer.forward + embed.forward + head.forward
                    kb = run.model.layers * (layer.backward + (layer.forward if full else 0.0)) + embed.backward + head.backward
                    whole, ends, action = layer_seconds(run, hw), end_seconds(run, hw, 0), runtime_seconds(run, hw)[0]
                    old, new = predict_run(cfg, kernels), predict_run(cfg, hw)
                    end = got["step"] - got["runner"]
                    print(f"{name} m={m} {recompute}: measured step {ms(got['step'])} ms = runtime {ms(got['runner'])} "
                          f"(per micro-batch F {ms(got['F'])}, B {ms(got['B'])}) + step end {ms(end)} (optimizer "
                          f"{ms(got['optimizer'])}, norm/clip {ms(got['clip'])}, batch {ms(got['data'])}, agree "
                          f"{ms(got['agree'])}, gradient finish {ms(got['grad_finish'])}, zeroing {ms(got['zero_grad'])}, "
                          f"the rest {ms(end - sum(got[k] for k in STEP_END))})")
                    print(f"    kernels: step {ms(old.step_time_s)} F {ms(kf)} B {ms(kb)} end {ms(old.time['optimizer'])}"
                          f"  error {100 * (old.step_time_s / got['step'] - 1):+.0f}%")
                    wf = run.model.layers * whole.forward + ends.forward + action
                    wb = run.model.layers * whole.backward + ends.backward + action
                    print(f"    whole:   step {ms(new.step_time_s)} F {ms(wf)} B {ms(wb)} end "
                          f"{ms(new.time['optimizer'])}  error {100 * (new.step_time_s / got['step'] - 1):+.0f}%")


def _two_ranks(hw: Any, steps: int) -> None:
    """Rank 0's measured parts of two-rank layouts beside the prediction's: the step, the runner (its F and B per
    micro-batch), the gradient finish and the step end, against the simulated pipeline, the exposed data-parallel
    time and the step end priced."""
    from modelpar.calibrate.validate_local import BASE, MODELS
    from modelpar.costmodel.local import stage_costs
    from modelpar.distributed import LocalCluster
    from modelpar.training.prediction import local_run, predict_run

    ms = lambda x: f"{1e3 * x:6.2f}"  # noqa: E731
    layouts = [{"dp": 2, "zero": z} for z in range(4)] + [{"pp": 2}]
    with LocalCluster(2, timeout=300.0, run_timeout=None) as cluster:
        for change in layouts:
            cfg = dataclasses.replace(BASE, model=MODELS["h128"], microbatches=4, tp=1, pp=1, dp=1)
            cfg = dataclasses.replace(cfg, **change).check(2)
            got = cluster.run(_rank, cfg, steps)[0]
            pred, costs = predict_run(cfg, hw), stage_costs(local_run(cfg), hw)
            end = got["step"] - got["runner"] - got["grad_finish"]
            print(f"h128 m=4 {change}: measured step {ms(got['step'])} ms = runner {ms(got['runner'])} (F {ms(got['F'])}, "
                  f"B {ms(got['B'])}) + gradient finish {ms(got['grad_finish'])} + step end {ms(end)}")
            print(f"    predicted step {ms(pred.step_time_s)} = pipeline {ms(pred.time['pipeline'])} (F "
                  f"{ms(costs.forward[0])}, B {ms(costs.input_grad[0] + costs.weight_grad[0])}) + data parallel "
                  f"{ms(pred.time['dp'])} + step end {ms(pred.time['optimizer'])}  error "
                  f"{100 * (pred.step_time_s / got['step'] - 1):+.0f}%")


if __name__ == "__main__":
    main()
