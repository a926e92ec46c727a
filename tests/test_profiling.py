import dataclasses
import logging

import pytest
import torch

from fxmem.profiling import (
    Mark,
    PerfState,
    StepResult,
    get_memory_stats,
    print_memory,
    reset_peak_memory,
    step_perf,
)


def test_cpu_peak_and_marks_exact():
    # The CPU allocator reports requested sizes, no rounding: 3001 bytes stays 3001.
    with step_perf("cpu", batch_size=8) as perf:
        a = torch.empty(1000, dtype=torch.float32)  # +4000
        perf.mark("a")
        b = torch.empty(3001, dtype=torch.uint8)  # +3001 -> 7001 live (the peak)
        perf.mark("b")
        del a  # -4000 -> 3001
        perf.mark("del_a")
        c = torch.empty(500, dtype=torch.float64)  # +4000 -> 7001 again, not higher
        perf.mark("c")
        del b, c
    r = perf.result
    assert r.peak_bytes == 7001
    assert r.peak_gb == pytest.approx(7001 / 1e9)
    assert r.baseline_bytes is None
    assert r.batch_size == 8 and r.throughput == pytest.approx(8 / r.time_s)
    assert [(m.name, m.live_bytes, m.peak_bytes) for m in r.marks] == [
        ("a", 4000, 4000),
        ("b", 7001, 7001),
        ("del_a", 3001, 7001),
        ("c", 7001, 7001),
    ]
    times = [m.time_s for m in r.marks]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= r.time_s


def test_repeated_mark_names_and_empty_block():
    with step_perf("cpu") as perf:
        perf.mark("x")
        t = torch.empty(10, dtype=torch.uint8)
        perf.mark("x")
        del t
    assert [(m.name, m.live_bytes) for m in perf.result.marks] == [("x", 0), ("x", 10)]
    assert perf.result.peak_bytes == 10 and perf.result.throughput is None

    with step_perf("cpu") as perf:
        pass
    assert perf.result.peak_bytes == 0 and perf.result.marks == ()


def test_free_of_earlier_tensor_is_relative():
    # A block allocated under an earlier profiler session has a known size, so freeing it
    # inside the step gives a negative event: live bytes go below the entry level.
    with step_perf("cpu"):
        old = torch.empty(5000, dtype=torch.uint8)
    with step_perf("cpu") as perf:
        del old  # -5000
        perf.mark("freed")
        x = torch.empty(1000, dtype=torch.uint8)  # -4000 relative: still below entry
        perf.mark("x")
        del x
    r = perf.result
    assert r.peak_bytes == 0
    assert [(m.live_bytes, m.peak_bytes) for m in r.marks] == [(-5000, 0), (-4000, 0)]


def test_memory_false_times_only():
    with step_perf("cpu", batch_size=4, memory=False) as perf:
        t = torch.empty(100)
        perf.mark("m")
        del t
    r = perf.result
    assert r.peak_bytes is None and r.peak_gb is None and r.time_s >= 0
    assert r.marks[0].live_bytes is None and r.marks[0].peak_bytes is None
    assert r.throughput == pytest.approx(4 / r.time_s)


def test_training_step_peak_covers_activation():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 64)
    with step_perf("cpu", batch_size=16) as perf:
        out = model(x)
        perf.mark("forward")
        out.square().mean().backward()
        perf.mark("backward")
        opt.step()
        opt.zero_grad()
    r = perf.result
    act = 16 * 32 * 4
    fwd, bwd = r.marks
    assert fwd.live_bytes >= act
    # Backward adds the weight and bias gradients while the output is still alive.
    grads = (64 * 32 + 32) * 4
    assert r.peak_bytes >= act + grads
    assert bwd.peak_bytes <= r.peak_bytes


def test_exception_propagates_without_result():
    with pytest.raises(KeyError):
        with step_perf("cpu") as perf:
            raise KeyError("boom")
    assert perf.result is None
    with step_perf("cpu") as perf:  # the profiler was shut down: a new block works
        pass
    assert perf.result.peak_bytes == 0


def test_mark_outside_block_and_nested_profiler():
    perf = step_perf("cpu")
    with pytest.raises(RuntimeError, match="outside"):
        perf.mark("x")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="already running"):
            with step_perf("cpu"):
                pass
        with step_perf("cpu", memory=False) as perf:
            pass
    assert perf.result.time_s >= 0


@pytest.mark.parametrize("bad", ["gpu", "cpu:x", "meta", 3.5])
def test_bad_device(bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        step_perf(bad)
    with pytest.raises(ValueError):
        get_memory_stats(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_unavailable_is_value_error():
    with pytest.raises(ValueError, match="CUDA"):
        step_perf("cuda")


def test_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        step_perf("cpu", batch_size=0)


def _result(t, peak, bs=None):
    return StepResult(device="cpu", time_s=t, peak_bytes=peak, batch_size=bs)


def test_perf_state_statistics():
    s = PerfState(warmup=1)
    assert s.to_dict()["steps"] == 0 and s.median_time_s is None and s.max_peak_bytes is None
    s.add(_result(10.0, 10**9, bs=8))  # warm-up: slow compile step, ignored
    s.add(_result(1.0, 200, bs=8))
    s.add(_result(3.0, 500, bs=8))
    s.add(_result(2.0, 100, bs=8))
    assert len(s.results) == 4 and len(s.measured) == 3
    assert s.median_time_s == 2.0
    assert s.max_peak_bytes == 500
    assert s.to_dict(prefix="run/") == {
        "run/step_time_median_s": 2.0,
        "run/peak_bytes": 500,
        "run/peak_gb": 500 / 1e9,
        "run/steps": 3,
        "run/throughput": 4.0,
    }
    s0 = PerfState(warmup=0)
    s0.add(_result(1.0, None))
    d = s0.to_dict()
    assert d["peak_bytes"] is None and d["peak_gb"] is None and d["throughput"] is None
    assert d["steps"] == 1
    with pytest.raises(ValueError):
        PerfState(warmup=-1)
    with pytest.raises(TypeError):
        s0.add({"time_s": 1.0})


def test_step_result_is_frozen():
    r = _result(1.0, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.time_s = 2.0
    m = Mark("a", 0.1, 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.name = "b"


def test_memory_stats_and_print(caplog):
    stats = get_memory_stats("cpu")
    assert set(stats) == {"rss_bytes"}
    assert stats["rss_bytes"] is None or stats["rss_bytes"] > 0
    reset_peak_memory("cpu")  # no-op, must not fail
    with caplog.at_level(logging.INFO, logger="fxmem"):
        line = print_memory("cpu", label="after step")
    assert line.startswith("after step: memory[cpu]") and "rss=" in line
    assert line in caplog.messages


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_peak_and_marks():
    dev = torch.device("cuda")
    keep = torch.empty(1 << 20, device=dev)
    torch.cuda.synchronize()
    with step_perf(dev, batch_size=2) as perf:
        a = torch.empty(1 << 20, dtype=torch.uint8, device=dev)  # 1 MiB: multiple of 512
        perf.mark("a")
        del a
        perf.mark("freed")
    r = perf.result
    assert r.baseline_bytes >= keep.numel() * 4
    assert r.peak_bytes == 1 << 20
    assert [(m.live_bytes, m.peak_bytes) for m in r.marks] == [(1 << 20, 1 << 20), (0, 1 << 20)]
    assert set(get_memory_stats(dev)) == {"allocated_bytes", "reserved_bytes", "max_allocated_bytes"}
    reset_peak_memory(dev)


def test_garbage_from_before_the_step_is_not_freed_inside_it():
    """A cycle of tensors left by an earlier measured step, freed by the cyclic collector
    mid-step, would show as a negative allocation and hide the step's own peak."""
    import gc

    with step_perf("cpu"):  # allocated under a profiler: its free is reported in the next
        cycle = [torch.ones(2**18)]  # 1 MiB
    cycle.append(cycle)
    del cycle
    with step_perf("cpu") as perf:
        kept = [[] for _ in range(20000)]  # objects enough to trigger the collector
        x = torch.ones(2**16)  # 256 KiB
    del x, kept
    assert perf.result.peak_bytes == 2**18
    assert gc.isenabled()
