"""The kernel measurement cache and child (fxmem.measurements): validated on read, merged on
write, never able to fail a compile."""
import json
import logging
import multiprocessing

import pytest
import torch

import fxmem
import fxmem.graph.measured as measured_mod
from fxmem import measurements
from fxmem.measurements import MAX_BYTES, read, write


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder for this test, and no measurements in memory (before and after)."""
    monkeypatch.setenv("FXMEM_CACHE", str(tmp_path))
    measured_mod.known.cache_clear()
    yield tmp_path / "scratch.json"
    measured_mod.known.cache_clear()


@pytest.mark.parametrize("content", [b"[1, 2]", b"5", b"null", b'"text"', b"{not json", b"\xff\xfe{}", b""])
def test_a_cache_file_of_the_wrong_type_is_ignored_and_replaced_on_write(cache, content):
    cache.write_bytes(content)
    assert read(cache) == {}
    write(cache, {"k": 3})
    assert json.loads(cache.read_text()) == {"k": 3}


def test_entries_that_are_not_whole_bytes_in_range_are_ignored(cache):
    cache.write_text(json.dumps({"ok": 7, "zero": 0, "max": MAX_BYTES, "negative": -5, "absurd": 1e308,
                                 "too_big": MAX_BYTES + 1, "float": 10.0, "bool": True, "string": "12",
                                 "null": None, "list": [1]}))
    assert read(cache) == {"ok": 7, "zero": 0, "max": MAX_BYTES}
    write(cache, {"new": 1, "bad": -1})  # what a writer adds is checked too
    assert json.loads(cache.read_text()) == {"ok": 7, "zero": 0, "max": MAX_BYTES, "new": 1}


def _write_many(path, worker, barrier):
    barrier.wait()
    for j in range(25):
        write(path, {f"{worker}-{j}": j})


def test_concurrent_writers_keep_each_others_entries(cache):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_write_many, args=(cache, i, barrier)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert json.loads(cache.read_text()) == {f"{i}-{j}": j for i in range(4) for j in range(25)}
    assert not [p.name for p in cache.parent.iterdir() if p.suffix == ".tmp"]


def test_an_unusable_cache_folder_warns_once_and_keeps_measurements_in_memory(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = blocker / "scratch.json"  # FXMEM_CACHE naming a file
    with caplog.at_level(logging.WARNING, logger="fxmem"):
        assert read(path) == {}
        write(path, {"k": 1})
        write(path, {"k": 2})
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all(str(path) in w for w in warned), warned  # one to read, one to write
    assert warned[1].startswith("fxmem: cannot write the kernel measurement cache") and "in memory" in warned[1]


def test_a_child_answering_garbage_counts_as_zero_and_is_not_cached(cache, tmp_path, monkeypatch, caplog):
    child = tmp_path / "child.py"
    child.write_text("print('[-1, 1e308]')")
    monkeypatch.setattr(measurements, "_CHILD", child)
    with caplog.at_level(logging.WARNING, logger="fxmem"):
        assert measurements.measure({"a": {}, "b": {}}) == {"a": 0, "b": 0}
    assert "could not measure kernel temporaries (expected 2 byte counts" in caplog.text
    assert not cache.exists()


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("on", True), ("0", False), ("off", False),
                                       ("False", False), ("no", False)])
def test_measuring_is_an_on_off_variable(monkeypatch, value, on):
    monkeypatch.setenv("FXMEM_MEASURE_SCRATCH", value)
    assert measurements.enabled() is on


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(8 * 8 * 8, 2)

    def forward(self, x):
        return self.head(self.conv(x).relu().flatten(1)).square().mean()


def _predicted_peak(model, x):
    torch._dynamo.reset()
    measured_mod.known.cache_clear()  # a new process: the measurements come from the disk cache
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager"})
    compiled(x).backward()
    (graph,) = fxmem.report(compiled).graphs
    return graph.predict_peak()


@pytest.mark.slow
def test_a_corrupt_cache_never_fails_a_compile_nor_changes_its_prediction(cache):
    """Measured once into a fresh cache; then with a cache of the wrong type (a list: it failed
    every compile) and with absurd entries (negative, 1e308): the same compile succeeds with the
    same prediction, and the cache holds valid measurements again."""
    torch.manual_seed(0)
    model, x = _Conv(), torch.randn(2, 3, 8, 8)
    want = _predicted_peak(model, x)
    good = json.loads(cache.read_text())
    assert len(good) == 2 and all(v >= 0 for v in good.values())  # the convolution, forward and backward
    assert want < 10**9
    for corrupt in ([1, 2], dict(zip(good, (-5, 1e308)))):
        cache.write_text(json.dumps(corrupt))
        assert _predicted_peak(model, x) == want, corrupt
        assert json.loads(cache.read_text()) == good
