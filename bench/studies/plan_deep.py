"""Planning models too large to run here: a Llama-7B config on the meta device.

``fxmem.explain_layers`` plans the model at 2 and 3 layers and extrapolates to 32 (exact on
identical layers: tests/test_realistic.py compares it with a full compile). Reports the wall
time, the predicted step peak at batch 2 x seq 2048, the resident bytes and ``max_batch`` for an
80 GB device at seq 2048 without and with Adam's state, at levels 0 and 1 (eager inner compiler).

    python bench/studies/plan_deep.py        # writes bench/results/realistic-plan-7b.{json,md}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

import common  # noqa: E402
import harness  # noqa: E402

import fxmem  # noqa: E402

LAYERS, SEQ = 32, 2048


def llama_7b(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return model


def main() -> None:
    ids = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    rows = []
    for level in (0, 1):
        torch._dynamo.reset()
        t = time.perf_counter()
        rep = fxmem.explain_layers(llama_7b, LAYERS, {"inner": "eager", "level": level}, input_ids=ids, labels=ids)
        seconds = time.perf_counter() - t
        rows.append(dict(level=level, seconds=round(seconds, 1), peak=rep.predict_peak(input_ids=(2, SEQ)),
                         resident=rep.resident_bytes(), resident_adam=rep.resident_bytes("adam"),
                         max_batch=rep.max_batch("80GB", seq=SEQ), max_batch_adam=rep.max_batch("80GB", seq=SEQ,
                                                                                                  optimizer="adam")))
        print(rows[-1], flush=True)
    harness.write("realistic-plan-7b", rows, meta=common.metadata("python bench/studies/plan_deep.py"))


if __name__ == "__main__":
    main()
