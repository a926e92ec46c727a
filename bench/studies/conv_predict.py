"""predict_peak against the measured peak on conv nets (issue #56: conv scratch per kernel), eager
inner compiler, levels 0 and 1, the zoo's ConvNeXt and ResNet (and the plain conv net, UNet):

    python bench/studies/conv_predict.py [--profile tiny|thorough] [--dynamic] [MODEL ...]

Prints one line per (model, level): measured peak (the third step), predicted, error. ``--dynamic``:
compiled once with ``dynamic=True`` at batch 4 and 32x32 images, then measured (the second step at
each shape) and predicted at other batches and image sizes from that one plan's formulas.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import fxmem
from fxmem.testing.zoo import conform, eager_step, zoo_build

MODELS = ("convnext", "resnet", "convnet", "unet")
SHAPES = ((4, 32), (2, 32), (8, 32), (4, 48), (8, 64))  # (batch, image size); the first is the plan's


def dynamic(name: str, level: int) -> None:
    from fxmem.profiling import step_perf
    from fxmem.testing.zoo import _images

    w = zoo_build(name, "tiny")
    model = w.model
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "level": level}, dynamic=True)

    def step(batch) -> int:
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            w.loss(compiled(**batch)).backward()
        return perf.result.peak_bytes

    for _ in range(3):  # HF classification heads recompile on the second call
        step(_images(*SHAPES[0], 10, 0))
    rep = fxmem.report(compiled)
    graph = rep.graphs[rep.step[-1]]  # the step's graph (one graph: no graph break in these models)
    for batch, size in SHAPES:
        images = _images(batch, size, 10, 0)
        for _ in range(2):
            measured = step(images)
        shapes = {"pixel_values": (batch, 3, size, size), "labels": (batch,)}
        try:
            pred = graph.predict_peak(**shapes)
        except ValueError:  # labels' size is not a symbol of the graph (the batch is pixel_values')
            pred = graph.predict_peak(pixel_values=shapes["pixel_values"])
        print(f"{name:10s} dynamic  L{level} batch {batch} size {size:3d}: measured {measured / 1024:8,.0f} KiB  "
              f"predicted {pred / 1024:8,.0f} KiB  error {pred / measured - 1:+.1%}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="tiny")
    p.add_argument("--levels", default="0,1")
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("models", nargs="*", default=list(MODELS))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    for name in a.models:
        if a.dynamic:
            for level in map(int, a.levels.split(",")):
                dynamic(name, level)
            continue
        w = zoo_build(name, a.profile)
        ref = copy.deepcopy(w.model)
        reference = ref, eager_step(ref, w)
        for level in map(int, a.levels.split(",")):
            c = conform(w, {"level": level}, reference)
            pred = fxmem.report(c.compiled).predict_peak()
            print(f"{name:10s} {a.profile:8s} L{level}: measured {c.peak_bytes / 1024:10,.0f} KiB  predicted "
                  f"{pred / 1024:10,.0f} KiB  error {pred / c.peak_bytes - 1:+.1%}  ok={c.ok}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
