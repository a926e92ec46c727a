"""One rank of the distributed checks in ``test_distributed.py`` (2 ranks, gloo, CPU, loopback).

    python dist_worker.py RANK WORLD PORT OUTDIR CLIP_NORM

Runs every check in ``CHECKS`` in order and writes, per check, ``OUTDIR/<check>.<rank>.pt`` (the
tensors the test compares with its single-process reference) or ``OUTDIR/<check>.<rank>.err``
(the traceback). The test runs the reference itself, without fxmem and without a process group.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from fxmem.testing import ModelSpec, build

# Small but not trivial: attention + MLP blocks, LayerNorm, an untied head; 8 sequences of 8.
SPEC = ModelSpec(vocab=32, d=16, blocks=("attention", "mlp"), hidden=32, heads=2, batch=8, seq=8)
# strict: a stage that fails raises instead of silently falling back to the plain partition.
OPTIONS = {"inner": "eager", "strict": True}
MICROBATCH = 2   # DP-SGD: each rank's 4 examples in chunks of 2
CHECKS = ("ddp", "fsdp2", "dpsgd")


def shard(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous part of the global batch (dim 0)."""
    n = SPEC.batch // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def planned_graphs(compiled) -> int:
    """How many graphs fxmem's planner planned (not the safe fallback) for ``compiled``."""
    import fxmem

    return sum(len(c.graphs) for c in fxmem.compilations(compiled))


def check_ddp(rank: int, world: int, clip_norm: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, batch = build(SPEC, seed=0)
    step = torch.compile(DDP(model), backend="fxmem", options=OPTIONS)
    loss = step(**shard(batch, rank, world))
    loss.backward()  # DDP all-reduces (averages) the gradients
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "loss": mean_loss, "planned": planned_graphs(step)}


def check_fsdp2(rank: int, world: int, clip_norm: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model, batch = build(SPEC, seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    step = torch.compile(model, backend="fxmem", options=OPTIONS)
    loss = step(**shard(batch, rank, world))
    loss.backward()  # FSDP2 reduce-scatters (averages) the gradients into DTensor shards
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    return {"grads": grads, "loss": mean_loss, "planned": planned_graphs(step),
            "sharded": sum(p.to_local().numel() for p in model.parameters()),
            "numel": sum(p.numel() for p in model.parameters())}


def check_dpsgd(rank: int, world: int, clip_norm: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fxmem.dpsgd import clipped_grad, make_functional

    model, batch = build(SPEC, seed=0)
    ddp = DDP(model)  # DP-SGD with DDP: functional per-example grads of the wrapped module
    fn, trainable, frozen = make_functional(ddp.module)

    def loss_fn(params, ids, labels):  # one example
        return fn(params, frozen, ids[None], labels[None])

    step = clipped_grad(loss_fn, clip_norm, batch_argnums=(1, 2), microbatch_size=MICROBATCH,
                        options=OPTIONS)
    part = shard(batch, rank, world)
    sums = step(trainable, part["input_ids"], part["labels"])
    sums = {n: g.clone() for n, g in sums.items()}
    for g in sums.values():  # the DP-SGD all-reduce: a SUM of the per-rank clipped sums
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
    return {"grads": sums, "microbatch": step.chosen_microbatch_size()}


def main(argv: list[str]) -> int:
    rank, world, port, outdir, clip_norm = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], float(argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=45))
    failed = 0
    try:
        for name in CHECKS:
            torch._dynamo.reset()
            try:
                out = globals()[f"check_{name}"](rank, world, clip_norm)
                torch.save(out, os.path.join(outdir, f"{name}.{rank}.pt"))
            except Exception:  # noqa: BLE001 - reported per check to the test
                failed += 1
                with open(os.path.join(outdir, f"{name}.{rank}.err"), "w") as f:
                    f.write(traceback.format_exc())
                traceback.print_exc()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
