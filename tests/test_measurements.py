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


def test_the_child_measures_an_expanded_argument(cache, caplog):
    """A per-example chunk's convolution backward takes its weight expanded over the batch (all
    strides 0): the child builds it over one element's storage (``copy_`` into overlapping
    elements raised, and the whole batch of configurations counted as 0)."""
    weight = {"shape": [16, 3, 3, 3], "dtype": "float32", "stride": [0, 0, 0, 0]}
    channels_last = {"shape": [1, 12, 8, 8], "dtype": "float32", "stride": [768, 1, 96, 12]}
    config = {"op": "convolution_backward", "overload": "default",
              "args": [{"shape": [1, 16, 8, 8], "dtype": "float32"}, channels_last, weight, None, [1, 1], [1, 1],
                       [1, 1], False, [0, 0], 4, [False, True, False]]}
    with caplog.at_level(logging.WARNING, logger="fxmem"):
        found = measurements.measure({"conv": config})
    assert "could not measure" not in caplog.text
    assert json.loads(cache.read_text()) == found


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


def test_a_named_pipe_as_the_cache_is_ignored_with_a_warning_not_waited_on(cache, caplog):
    """``open`` of a FIFO blocks until a writer comes: read() must refuse it without opening it
    blocking (the read runs in a thread; if it hangs, a writer end unblocks it and the test fails)."""
    import os
    import threading

    os.mkfifo(cache)
    got = []
    reader = threading.Thread(target=lambda: got.append(read(cache)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="fxmem"):
        reader.start()
        reader.join(10)
        hung = reader.is_alive()
        if hung:  # unblock the reader's open(): a writer end, closed at once
            os.close(os.open(cache, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(10)
        assert not hung, "read() blocked on a named pipe"
        assert got == [{}]
        write(cache, {"k": 3})  # a writer ignores it too, and replaces it with a regular file
    assert json.loads(cache.read_text()) == {"k": 3}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"ignoring the kernel measurement cache {cache}" in warned[0], warned
    assert "not a regular file" in warned[0]


def test_no_file_is_created_or_written_through_a_symbolic_link(cache, tmp_path, caplog):
    """A lock file or cache file that is a link pointing outside the cache folder: the target is
    never created nor written; a linked lock is refused with one warning (the cache stays in memory)."""
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    lock_target, cache_target = outside / "lock", outside / "scratch.json"
    cache_target.write_text('{"theirs": 1}')
    cache.symlink_to(cache_target)
    lock = cache.with_name("scratch.json.lock")
    lock.symlink_to(lock_target)
    with caplog.at_level(logging.WARNING, logger="fxmem"):
        write(cache, {"k": 3})
        write(cache, {"k": 4})
    assert not lock_target.exists() and lock.is_symlink()
    assert cache_target.read_text() == '{"theirs": 1}'
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(f"fxmem: cannot write the kernel measurement cache {cache}")
    assert f"the lock file {lock} is a symbolic link; allowed: a regular file" in warned[0]
    lock.unlink()  # a regular lock: the link to the cache file is replaced, its target kept
    write(cache, {"k": 5})
    assert not cache.is_symlink() and json.loads(cache.read_text()) == {"theirs": 1, "k": 5}
    assert cache_target.read_text() == '{"theirs": 1}'


def test_an_implausible_cache_entry_is_dropped_with_a_warning_and_measured_again(cache, tmp_path, monkeypatch,
                                                                                caplog):
    """2**50 bytes of temporaries for a 2x3x8x8 convolution (a crafted or corrupt entry, valid
    JSON bytes otherwise) must not reach a prediction: measured again, and the cache corrected."""
    from fxmem.graph.measured import _config
    from fxmem.graph.scratch import op_scratch

    aten = torch.ops.aten
    x, w = torch.randn(2, 3, 8, 8), torch.randn(8, 3, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    key, _ = _config(aten.convolution.default, args)
    plausible = 10**6  # hundreds of times this shape's tensors, but possible: trusted
    other = key.replace("[2, 3, 8, 8]", "[1, 3, 8, 8]")
    cache.write_text(json.dumps({key: 2**50, other: plausible}))
    child = tmp_path / "child.py"  # the "measurement": 1234 bytes per configuration
    child.write_text("import json, sys\nprint(json.dumps([1234] * len(json.load(sys.stdin)['configs'])))")
    monkeypatch.setattr(measurements, "_CHILD", child)
    with caplog.at_level(logging.WARNING, logger="fxmem"):
        assert int(op_scratch(aten.convolution.default, args, {}, None)) == 1234
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"ignoring 1 implausible entry of the kernel measurement cache {cache}" in warned[0]
    assert f"{2**50} bytes of temporaries for an aten.convolution call" in warned[0]
    assert json.loads(cache.read_text()) == {key: 1234, other: plausible}
    assert measured_mod.known()[other] == plausible


@pytest.mark.parametrize("blank", [" ", "\t\n", ""])
def test_a_blank_cache_variable_is_unset(monkeypatch, tmp_path, blank):
    monkeypatch.setenv("FXMEM_CACHE", blank)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert measurements.cache_file() == tmp_path / ".cache" / "fxmem" / "scratch.json"
    monkeypatch.setenv("FXMEM_CACHE", f" {tmp_path / 'c'} ")  # blanks around a path: stripped, as elsewhere
    assert measurements.cache_file() == tmp_path / "c" / "scratch.json"
