"""``options={"step_in_backward": optimizer}``: each parameter's optimizer step runs inside the
compiled backward as soon as its gradient is final, and the gradient dies there.

A compiled backward returns every parameter gradient at once, so at its end all of them are
alive (as many bytes as the weights); an optimizer step in a post-accumulate-grad hook cannot
help there. fxmem rewrites the backward graph instead (:func:`rewrite`): each gradient that the
graph returns for a parameter of ``optimizer`` is handed to ``fxmem::step_in_backward`` where it
is computed, after the last read of that parameter (or of a view of it) in the backward, and the
graph returns None in its place. The op looks the parameter up by a key baked into the graph
(:class:`InBackward` owns the table) and runs the optimizer's own step function on that one
parameter, with its group's hyperparameters as they are now (LR schedulers work), its state in
``optimizer.state`` (``state_dict()`` saves and restores it), and its gradient then dropped.
For every optimizer whose update of a parameter reads only that parameter's gradient and state
(SGD, Adam, AdamW and the other per-parameter ones in :data:`SUPPORTED`) this is the step a full
backward then ``optimizer.step()`` would take: the same function on the same numbers.

What a graph cannot finish (a parameter that another compiled graph or plain PyTorch code also
reads, a graph that fell back to the safe plan) is accumulated in ``.grad`` (by autograd, with a
post-accumulate-grad hook, or by the op) and the parameter is updated when the backward ends
(``queue_callback``), from its whole gradient. Which parameters those are shows in the first
backward, which accumulates every gradient so (its peak is a plain step's); from the second on
the others are updated early. Only a use that appears later (plain PyTorch code reading a
parameter after a data-dependent branch) cannot be repaired for that step: it raises, and the
parameter is accumulated from then on.

The user's loop is ``loss.backward()`` (then the scheduler's ``step()``): ``optimizer.step()``
is a no-op after it (one warning), and ``zero_grad()`` finds no gradient to clear. What needs every
gradient before any update cannot work in one pass and raises: a closure, gradient accumulation
(``step()`` after several backwards).
"""

from .runtime import SUPPORTED, InBackward, StepInBackwardError, check_optimizer

__all__ = ["SUPPORTED", "InBackward", "StepInBackwardError", "check_optimizer"]
