"""Random ops the backward may recompute, bit-identically: replay their generator.

Random ops reach the planner in two forms:

- Under Inductor's decompositions they are functional already: one ``inductor_seeds`` node draws
  every seed of the graph, ``inductor_lookup_seed(seeds, i)`` picks one, and
  ``inductor_random(shape, seed)`` is a pure function of its seed, so recomputing it draws the
  same numbers (the allowlist lists it as cheap; each op's seed, 8 bytes, is kept).
- aten's random ops (the eager inner compiler, Inductor with ``fallback_random``) draw from the
  device's generator. :func:`make_replayable` gives each the generator state it starts from:
  ``state = generator_state(device)`` then ``run_with_rng_state(state, op, *args)``. The planner
  sees an op with one tiny input that cannot be recomputed (so is kept when the op is
  recomputed: 5 KB on CPU, 16 bytes on CUDA, where the state is Philox's seed and offset).

After the split, :func:`bind_states` puts the forward in its run form: ``run_and_save_rng_state(op,
*args)`` where the backward replays the op (one node, so nothing draws between reading the state
and drawing), the op alone where it does not. The backward's copies set the saved state, draw,
and restore the generator. torch's ``functionalize_rng_ops`` makes the same pair after its
partition; here it exists before planning, so the min-cut can choose to recompute random ops.
"""

from __future__ import annotations

import operator

import torch
import torch._inductor.inductor_prims  # noqa: F401 - registers prims.inductor_* (seeded random ops)
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from ..graph.joint import JointGraph, is_random

prims = torch.ops.prims


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default generator (what ``run_and_save_rng_state`` returns)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return getattr(torch, device.type).get_rng_state(device)


def _device(node: fx.Node) -> torch.device:
    dev = node.kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def _state_val(device: torch.device, fake_mode) -> torch.Tensor:
    numel = generator_state(device).numel()  # 5056 bytes on CPU (mt19937), 16 on CUDA
    with fake_mode:
        return torch.empty(numel, dtype=torch.uint8)


def is_state(node: fx.Node) -> bool:
    """A node that only reads a generator (the seeds Inductor draws, a replay state): tiny, and
    never recomputed."""
    return node.op == "call_function" and node.target in _STATES


# ``inductor_lookup_seed(seeds, i)`` is a state too: the backward keeps each random op's own seed
# (8 bytes), not the graph's seed buffer, which every replayed draw would read. Inductor fuses
# kernels that read a common buffer, so with the buffer it pulled every layer's recomputed mask
# into one kernel at the start of the backward (GPT-2 with dropout: 73 MiB measured, 34 planned).
_STATES = (generator_state, prims.inductor_seeds.default, prims.inductor_lookup_seed.default)


def wrapped_target(node: fx.Node):
    """The random op a replay node runs, else None."""
    if node.op == "call_function" and node.target is run_with_rng_state:
        return node.args[1]
    return None


def make_replayable(joint: JointGraph) -> int:
    """Give each forward aten random op its generator state (rewrites ``joint.gm`` in place).
    Returns how many ops were rewritten; the caller re-reads the joint graph's regions."""
    graph = joint.gm.graph
    todo = [n for n in graph.nodes if n in joint.forward and is_random(n)]
    if not todo:
        return 0
    fake_mode = detect_fake_mode([a.meta["val"] for n in todo for a in n.all_input_nodes if "val" in a.meta])
    for n in todo:
        device = _device(n)
        with graph.inserting_before(n):
            state = graph.call_function(generator_state, (device,))
            replay = graph.call_function(run_with_rng_state, (state, n.target, *n.args), dict(n.kwargs))
        state.meta = {k: v for k, v in n.meta.items() if k in ("nn_module_stack", "stack_trace", "seq_nr")}
        state.meta["val"] = _state_val(device, fake_mode) if fake_mode else torch.get_rng_state()
        replay.meta = dict(n.meta)
        n.replace_all_uses_with(replay)
        graph.erase_node(n)
    graph.lint()
    joint.gm.recompile()
    return len(todo)


def bind_states(fw: fx.GraphModule) -> int:
    """The forward's run form of each replay pair (see the module doc); returns how many states
    the forward now hands to the backward."""
    graph, saved = fw.graph, 0
    replays = [n for n in graph.nodes if wrapped_target(n) is not None]
    if not replays:  # most graphs (no random op): nothing to rewrite, no recompile
        return 0
    for replay in replays:
        state, op, *args = replay.args
        with graph.inserting_before(replay):
            if len(state.users) > 1:  # the state is also a forward output: the backward replays
                pair = graph.call_function(run_and_save_rng_state, (op, *args), dict(replay.kwargs))
                pair.meta["val"] = (state.meta["val"], replay.meta["val"])
                new_state = graph.call_function(operator.getitem, (pair, 0))
                new_state.meta = dict(state.meta)
                out = graph.call_function(operator.getitem, (pair, 1))
                saved += 1
            else:
                new_state, out = None, graph.call_function(op, tuple(args), dict(replay.kwargs))
        out.meta = dict(replay.meta)
        replay.replace_all_uses_with(out)
        graph.erase_node(replay)
        if new_state is not None:
            state.replace_all_uses_with(new_state)
        graph.erase_node(state)
    if graph.find_nodes(op="call_function", target=generator_state):
        raise AssertionError("a generator state without its random op in the forward graph")
    graph.lint()
    fw.recompile()
    return saved
