"""Shared test helpers: compare a compiled training step with eager."""

import contextlib
import copy
import importlib.util
import sys
from datetime import timedelta
from pathlib import Path

import torch


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = a.abs().max().clamp_min(1e-12)
    return ((a - b).abs().max() / scale).item()


def compare_step(workload, compile_fn, rtol=1e-5, batches=None):
    """Run loss+backward in eager and through ``compile_fn(model)``; assert loss and grads agree."""
    ref, test = workload.model, copy.deepcopy(workload.model)
    compiled = compile_fn(test)
    for batch in batches or [workload.batch]:
        ref.zero_grad(set_to_none=True)
        test.zero_grad(set_to_none=True)
        l_ref = workload.loss(ref(**batch))
        l_ref.backward()
        l_test = workload.loss(compiled(**batch))
        l_test.backward()
        assert max_rel_err(l_ref.detach(), l_test.detach()) <= rtol, (l_ref, l_test)
        for (name, p), q in zip(ref.named_parameters(), test.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                err = max_rel_err(p.grad, q.grad)
                assert err <= rtol, f"{name}: relative error {err}"
    return compiled


def load_bench_models():
    """``bench/dpsgd_models.py`` (the DP-SGD benchmark's GPT), shared by the DP-SGD tests."""
    return load_bench_module("dpsgd_models")


def load_bench_module(name: str):
    """``bench/<name>.py`` as a module."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # Dynamo looks the model's module up by name
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    """A free TCP port on localhost (for a process group's rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world: int):
    """A spawned rank's gloo process group on localhost (one thread), destroyed on exit."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=45))
    try:
        yield
    finally:
        dist.destroy_process_group()
