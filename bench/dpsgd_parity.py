"""make_private on the 5.3M GPT (bench/dpsgd_models.py's GPT at vocab 4096, d 256, 4 layers,
4 heads, sequence 64: bench/gpu.py's DP shape), the Opacus user's loop unchanged, on one
process or on 2 gloo ranks: loss, epsilon and step time per step, written in the results
contract format to ``bench/results/dpsgd-parity.json`` (and the table beside it).

    nice python -m bench.dpsgd_parity --steps 4                 # 1 process
    nice python -m bench.dpsgd_parity --steps 4 --world 2       # 2 gloo ranks (same global batch)

The head-to-head with Opacus (non-private, hooks, ghost, make_private, clipped_grad at equal
epsilon) is bench/e2e_dpsgd.py --model gpt5m (and --model bert).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bench.dpsgd_models import GPT

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the harness, as its scripts import it
import common  # noqa: E402
import harness  # noqa: E402
import results_format  # noqa: E402

OUT = Path(__file__).with_name("results") / "dpsgd-parity"
DELTA = 1e-5
SHAPE = dict(vocab=4096, d=256, layers=4, heads=4, max_seq=64)


class LM(GPT):
    """The GPT returning logits ``[b, t, vocab]``: the user's loop applies the criterion."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def criterion(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the batch's tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def train(rank: int, world: int, args, port: int, out: dict) -> list[dict]:
    from fxmem.dpsgd import make_private

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = LM(**SHAPE)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 4096, (args.dataset, 64), generator=g)
        loader = DataLoader(TensorDataset(ids), batch_size=args.batch // world)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt, loader = make_private(module=model, optimizer=opt, data_loader=loader,
                                          noise_multiplier=args.noise, max_grad_norm=1.0, accountant="rdp",
                                          microbatch_size=args.microbatch, options={"inner": args.inner})
        rows = []
        for step, (x,) in enumerate(loader):
            if step == args.steps:
                break
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = criterion(model(x), x)
            loss.backward()
            opt.step()
            rows.append(dict(step=step, batch=len(x), loss=loss.item(), epsilon=opt.epsilon(DELTA),
                             step_s=time.perf_counter() - t0))
            if rank == 0:
                print(rows[-1], flush=True)
        out[rank] = rows
        return rows
    finally:
        if world > 1:
            dist.destroy_process_group()


def _spawned(rank, world, args, port, q):
    q.put((rank, train(rank, world, args, port, {})))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dataset", type=int, default=1024)
    ap.add_argument("--microbatch", type=int, default=8)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--inner", default="eager")
    args = ap.parse_args()
    if args.world == 1:
        rows = train(0, 1, args, 0, {})
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_spawned, args=(r, args.world, args, port, q)) for r in range(args.world)]
        for p in procs:
            p.start()
        got = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
        rows = got[0]
    path = OUT.with_suffix(".json")
    old = results_format.read(path) if path.exists() else None  # the other world size's run stays
    records = [results_format.unflatten(r) for r in results_format.pivot(old.rows).values()] if old else []
    records = [r for r in records if r["world"] != args.world] + [
        {"world": args.world, "step": r["step"], **{k: r[k] for k in ("batch", "loss", "epsilon", "step_s")}}
        for r in rows]
    meta = {**common.metadata(f"python -m bench.dpsgd_parity --steps {args.steps} --world {args.world} "
                              f"--batch {args.batch} --microbatch {args.microbatch} --inner {args.inner}"),
            "load": os.getloadavg(), "noise_multiplier": args.noise, "delta": DELTA, "dataset": args.dataset,
            "shape": SHAPE, "params": sum(p.numel() for p in LM(**SHAPE).parameters()),
            "note": "batch = rank 0's Poisson batch; loss = rank 0's batch mean"}
    harness.write("dpsgd-parity", records, OUT.parent, meta=meta)

if __name__ == "__main__":
    main()
