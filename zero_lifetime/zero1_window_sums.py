"""ZeRO-1 with gradient accumulation: a backward that dies keeps the window's earlier micro-steps.

ZeRO-1 reduces only in the backward that closes a window. Until then torch sums each
micro-step into ``param.grad`` (DeepSpeed moves it into ``param.grad_accum`` when it
accumulates in another dtype), and that sum is the window's only copy. The cleanup after a
dead backward dropped every ``param.grad``, as is right where the sums live in DeepSpeed's
partitions (ZeRO-2 and 3, or ZeRO-1 within one micro-step): with GAS > 1 a backward dying
in a later micro-step took the earlier ones with it, silently.

So once earlier micro-steps have summed into ``param.grad``, a dead backward keeps it, and
with it what the dead backward reached (torch keeps that too; the two are one tensor), unless
it died in the closing micro-step after DeepSpeed's hooks had begun moving sums into the
buckets that die with it: part of the window is gone then, and the next backward or
``step()`` raises until ``zero_grad()``, instead of stepping on what is left. Before any
micro-step has summed, the dead backward adds nothing, as on every stage.
"""

WINDOW_LOST = (
    "zero_lifetime: a backward died in the micro-step that closes the gradient accumulation window "
    "(ZeRO-1), after DeepSpeed had moved part of the window's summed gradients into its reduction "
    "buckets: they were dropped with the dead backward. Call engine.zero_grad() and run the window "
    "again; a step() now would apply only what is left of it.")


class Zero1WindowSums:

    def __init__(self, at_boundary):
        """``at_boundary()``: does the running micro-step close the window?"""
        self._at_boundary = at_boundary
        self._sums_in_grads = False  # earlier micro-steps wait, unreduced, in param.grad
        self._closing = False  # the running backward is in the closing micro-step
        self._lost = False

    def refuse_if_lost(self) -> None:
        """Before a backward that accumulates, or step(), changes anything."""
        if self._lost:
            raise RuntimeError(WINDOW_LOST)

    def backward_started(self) -> None:
        self._closing = self._at_boundary()

    def backward_finished(self) -> None:
        # The closing epilogue reduced every param.grad; any other backward summed into it.
        self._sums_in_grads = not self._closing

    def backward_died(self, reached_window_sums: bool) -> bool:
        """``reached_window_sums``: the dead backward reached a param that an earlier backward of
        the window had reached (in the closing micro-step DeepSpeed's hook moves that param's sum
        into a bucket). A param the window had not reached held no sum: what the dead backward
        moved of it is lost as on every stage, and the window is whole. (DeepSpeed's own "buckets
        ready" flag cannot tell: at GAS > 1 ZeRO-1 leaves it set from micro-step to micro-step.)
        Returns whether the cleanup must leave param.grad (and grad_accum) as they are."""
        if self._lost:
            return False
        if not self._sums_in_grads:
            return False  # param.grad holds only what the dead backward reached: it adds nothing
        if not self._closing:
            return True  # what it reached stays with the sums, as in torch (the two are one tensor)
        if not reached_window_sums:
            return True  # no sum moved: param.grad still holds the earlier micro-steps
        self._lost = True
        return False

    def window_cleared(self) -> None:
        """zero_grad(), or a step() that closed the window."""
        self._sums_in_grads = False
        self._lost = False
