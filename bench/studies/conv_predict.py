"""predict_peak against the measured peak on conv nets (issue #56: conv scratch per kernel), eager
inner compiler, levels 0 and 1, the zoo's ConvNeXt and ResNet (and the plain conv net, UNet):

    python bench/studies/conv_predict.py [--profile tiny|thorough] [MODEL ...]

Prints one line per (model, level): measured peak, predicted, error.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import fxmem
from fxmem.testing.zoo import conform, eager_step, zoo_build

MODELS = ("convnext", "resnet", "convnet", "unet")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="tiny")
    p.add_argument("--levels", default="0,1")
    p.add_argument("models", nargs="*", default=list(MODELS))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    for name in a.models:
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
