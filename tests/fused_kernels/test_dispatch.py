"""Which implementation ``impl="auto"`` picks: the portable PyTorch one, on CUDA too, unless
``FXMEM_KERNELS_TRITON=1`` (the Triton kernels are not yet tested on a GPU). CUDA tensors are fake
here (FakeTensorMode makes them without a GPU): only the device is read."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem_kernels import _common
from fxmem_kernels._common import ENV_TRITON, use_triton

needs_triton = pytest.mark.skipif(not _common.HAS_TRITON, reason="needs the triton package")


@pytest.fixture
def cuda_tensor():
    with FakeTensorMode():
        yield torch.empty(4, 8, device="cuda")


@pytest.mark.parametrize("value", [None, "", "0", "false", "off"])
def test_auto_runs_the_portable_implementation_on_cuda_by_default(monkeypatch, cuda_tensor, value):
    if value is None:
        monkeypatch.delenv(ENV_TRITON, raising=False)
    else:
        monkeypatch.setenv(ENV_TRITON, value)
    assert cuda_tensor.is_cuda
    assert use_triton("auto", cuda_tensor) is False


@needs_triton
@pytest.mark.parametrize("value", ["1", "true", " Yes ", "on"])
def test_the_env_var_opts_in_to_triton_on_cuda_only(monkeypatch, cuda_tensor, value):
    monkeypatch.setenv(ENV_TRITON, value)
    assert use_triton("auto", cuda_tensor) is True
    assert use_triton("auto", torch.empty(4, 8)) is False  # CPU: the portable path, as before
    assert use_triton("torch", cuda_tensor) is False


@needs_triton
def test_explicit_impls_ignore_the_env_var(monkeypatch, cuda_tensor):
    monkeypatch.delenv(ENV_TRITON, raising=False)
    assert use_triton("triton", cuda_tensor) is True
    assert use_triton("triton", torch.empty(2)) is True  # the interpreter (tests)
    assert use_triton("torch", torch.empty(2)) is False


def test_a_bad_env_value_names_the_variable_and_what_is_allowed(monkeypatch, cuda_tensor):
    monkeypatch.setenv(ENV_TRITON, "maybe")
    with pytest.raises(ValueError, match=r"environment variable FXMEM_KERNELS_TRITON: got 'maybe'; "
                                         r"allowed: 1/true/yes/on or 0/false/no/off \(unset: off\)"):
        use_triton("auto", cuda_tensor)


def test_the_planner_sizes_the_fused_loss_workspace_for_the_path_that_runs(monkeypatch):
    """The fused cross-entropy's chunk of logits in flight (fxmem.graph.scratch) is sized for the
    portable path on CUDA by default (fp32 rows), for Triton's (input-dtype rows) when opted in."""
    import torch.fx as fx

    from fxmem.graph.scratch import scratch_bytes
    from fxmem_kernels.linear_cross_entropy import row_bytes

    vocab, workspace = 1000, 2**20
    graph = fx.Graph()
    h, w, t = (graph.placeholder(n) for n in ("hidden", "weight", "target"))
    with FakeTensorMode():
        vals = (torch.empty(64, 16, device="cuda", dtype=torch.bfloat16),
                torch.empty(vocab, 16, device="cuda", dtype=torch.bfloat16),
                torch.empty(64, dtype=torch.long, device="cuda"))
    for node, val in zip((h, w, t), vals):
        node.meta["val"] = val
    node = graph.call_function(torch.ops.fxmem.linear_cross_entropy.default, (h, w, None, t),
                               {"workspace_bytes": workspace, "impl": "auto"})

    def expected(triton_path):
        row = row_bytes(vocab, torch.bfloat16, None, triton_path)
        return min(64, workspace // row) * row

    monkeypatch.delenv(ENV_TRITON, raising=False)
    # the portable path: the chunk's rows, and its per-row vectors (tests/test_scratch.py)
    assert int(scratch_bytes(node)) == expected(False) + 64 * (37 + 1) + 4 == 64 * vocab * (4 + 2) + 64 * 38 + 4
    if _common.HAS_TRITON:
        monkeypatch.setenv(ENV_TRITON, "1")
        assert int(scratch_bytes(node)) == expected(True) == 64 * vocab * 2
