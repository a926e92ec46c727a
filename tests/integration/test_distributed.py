"""fxmem under torch.distributed: DDP, FSDP2 and DP-SGD with DDP, 2 ranks on CPU (gloo, loopback).

One launch of two rank processes (``dist_worker.py``) runs all three checks, each rank on its half
of a global batch of 8; each test below compares one check's results on both ranks with a
single-process reference over the whole batch, computed here in eager PyTorch without fxmem and
without a process group:

- DDP: the all-reduced (averaged) gradients of the compiled DDP model = the gradients of the
  whole batch's mean loss; fxmem planned the graph (strict, so no silent fallback).
- FSDP2: the full tensors of the sharded gradients = the same reference.
- DP-SGD: each rank's clipped sum (``fxmem.dpsgd.clipped_grad``, microbatches of 2), all-reduced
  with SUM = an explicit per-example loop's clipped sum over the whole batch.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call, grad

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
]

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 2
RTOL = 1e-5
TIMEOUT_S = 120  # the whole launch; gloo's own collective timeout in the worker is 45 s


def _load_worker():
    spec = importlib.util.spec_from_file_location("_fxmem_dist_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


worker = _load_worker()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


# --- single-process references ------------------------------------------------------------------


def reference_step():
    """Gradients and loss of one eager step over the whole batch (mean loss)."""
    model, batch = worker.build(worker.SPEC, seed=0)
    loss = model(**batch)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, loss.detach()


def reference_clipped():
    """(C, sum_i min(1, C/||g_i||) g_i) over the whole batch, by an explicit per-example loop; C is
    the median per-example norm, so that some examples are clipped and some are not."""
    model, batch = worker.build(worker.SPEC, seed=0)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, ids, labels):
        return functional_call(model, p, (ids[None], labels[None]))

    per_example = [grad(loss)(params, batch["input_ids"][i], batch["labels"][i])
                   for i in range(worker.SPEC.batch)]
    norms = torch.stack([torch.sqrt(sum((g.double() ** 2).sum() for g in gs.values())) for gs in per_example])
    C = round(norms.median().item(), 4)
    assert (norms > C).any() and (norms < C).any(), (norms, C)
    total = {n: sum(gs[n].double() * min(1.0, C / nm.item()) for gs, nm in zip(per_example, norms)).float()
             for n in params}
    return C, total


# --- the launch -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(outdir: Path, clip_norm: float) -> str:
    """Run both ranks to completion (killed after TIMEOUT_S); return a summary of how they ended."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    procs = []
    for rank in range(WORLD):
        log = open(outdir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), str(rank), str(WORLD), str(port),
                                        str(outdir), repr(clip_norm)],
                                       stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.monotonic() + TIMEOUT_S
    ends = []
    for rank, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            ends.append(f"rank {rank}: exit code {rc}")
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            ends.append(f"rank {rank}: killed after {TIMEOUT_S} s (hung)")
        finally:
            log.close()
    return "; ".join(ends)


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("fxmem_dist")
    C, clipped = reference_clipped()
    grads, loss = reference_step()
    ended = launch(outdir, C)
    return outdir, ended, {"step": (grads, loss), "clipped": clipped}


def results(dist_run, check: str) -> list[dict]:
    """Each rank's saved results of ``check``; fails with the rank's traceback or log otherwise."""
    outdir, ended, _ = dist_run
    out = []
    for rank in range(WORLD):
        err = outdir / f"{check}.{rank}.err"
        if err.exists():
            pytest.fail(f"{check} failed on rank {rank} ({ended}):\n{err.read_text()}")
        res = outdir / f"{check}.{rank}.pt"
        if not res.exists():
            log = (outdir / f"rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"{check}: no result from rank {rank} ({ended}); end of its log:\n{log}")
        out.append(torch.load(res, weights_only=False))
    return out


def assert_grads_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for n, w in want.items():
        assert w.abs().max() > 0, f"{what}: reference gradient of {n} is zero"
        assert got[n].shape == w.shape, (what, n, got[n].shape, w.shape)
        err = rel_err(got[n], w)
        assert err <= RTOL, f"{what}: {n}: relative error {err:.2e} > {RTOL}"


# --- the checks -----------------------------------------------------------------------------------


def test_ddp_gradients_match_single_process(dist_run):
    want, want_loss = dist_run[2]["step"]
    for rank, res in enumerate(results(dist_run, "ddp")):
        assert res["planned"] >= 1, f"rank {rank}: fxmem planned no graph"
        assert rel_err(res["loss"], want_loss) <= RTOL, (rank, res["loss"], want_loss)
        assert_grads_equal(res["grads"], want, f"DDP rank {rank}")


def test_fsdp2_gradients_match_single_process(dist_run):
    want, want_loss = dist_run[2]["step"]
    for rank, res in enumerate(results(dist_run, "fsdp2")):
        assert res["planned"] >= 1, f"rank {rank}: fxmem planned no graph"
        assert res["sharded"] < res["numel"], f"rank {rank}: parameters not sharded"
        assert rel_err(res["loss"], want_loss) <= RTOL, (rank, res["loss"], want_loss)
        assert_grads_equal(res["grads"], want, f"FSDP2 rank {rank}")


def test_dpsgd_clipped_sums_all_reduce_to_single_process(dist_run):
    want = dist_run[2]["clipped"]
    for rank, res in enumerate(results(dist_run, "dpsgd")):
        assert res["microbatch"] == worker.MICROBATCH, f"rank {rank}: not chunked ({res['microbatch']})"
        assert_grads_equal(res["grads"], want, f"DP-SGD rank {rank}")
