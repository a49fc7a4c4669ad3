"""MemoryGuard: moves a training run to a lighter recipe under memory pressure, and back when memory frees up.

The controller (``AdaptiveMixedPrecision(..., memory_guard=MemoryGuard(...))``)
calls :meth:`MemoryGuard.after_step` after every step and
:func:`train_step` runs a whole step from a closure, so that an
out-of-memory error in the forward or backward pass is caught, the step's
partial work dropped (gradients, the recorded loss), the recipe made lighter
and the same batch run again: no data is lost, and the optimizer state is
converted, not reset.

Pressure is read every ``check_every`` steps as the *headroom*: on CUDA the
driver's free memory plus what torch's allocator caches unused
(``mem_get_info`` + reserved - allocated), and with a ``budget`` at most the
budget minus the peak allocated since the last read; elsewhere (or for
tests) from a ``reader`` callable returning bytes. Under ``min_free`` the
next move of the ladder is made, each an event of kind ``"memory_pressure"``:

1. ``"bf16-moments"``: the optimizer becomes adaptive_amp.optim's (stochastic
   rounding) with bf16 moments (4 bytes a parameter less with AdamW). The
   object the caller holds is converted in place (its class becomes
   adaptive_amp.optim's, its state the converted state), so that its
   ``state_dict()`` keeps every moment and step count, an LR scheduler keeps
   driving it, and a checkpoint saved the usual way loses nothing; undoing
   the move converts it back;
2. ``"bf16-weights"``: the matmul layers' weights and gradients in bf16,
   compute under bf16 autocast, no loss scaling (the policy "bf16-weights";
   4 bytes a weight less); fp32 islands stay, with their weights in fp32.
   Not "bf16-pure": with bf16 outside the matmuls too, a compiled 1.1B Llama
   ended 1.1% above torch's autocast after 2000 steps, with this 1.5% below
   it (bench/RESULTS.md);
3. ``"checkpoint"``: the model's blocks recompute activations in backward.

With ``allow_recover``, after ``recover_after`` steps at a headroom of at least
twice ``min_free`` plus twice what the last move freed, that move is undone
(event ``"memory_recovered"``): moments and weights upcast, blocks no longer checkpointed.

Under several processes (torch.distributed with more than one rank) the moves
are collective, as ranks training one model must run one recipe: each check
all-reduces whether some rank needs a move (and whether every rank could move
back), and :func:`train_step` all-reduces, after each forward and backward,
whether some rank ran out of memory, so that every rank drops its partial
step, moves and reruns its batch together. That holds where every rank
fails in the same pass, or where the peers of the rank that failed issue no
collective of their own until the check (a model neither DDP nor FSDP
wraps): under DDP or FSDP2 a rank that fails alone leaves its peers in a
gradient all-reduce, weight gather or reduce-scatter that it never joins,
and the process group's timeout ends the run. A guard's ``min_free``
headroom makes its move before an allocation fails.
"""

from __future__ import annotations

import gc
from typing import Callable, List, Optional, Sequence

import torch

from ._process_group import world_group
from .monitor import Event
from .policy import dtype_name
from .recipes import (cast_for_policy, cast_refusal, checkpoint_blocks, convert_optimizer_in_place, convertible,
                      find_blocks, policy_hooks)

#: The moves, lightest-cost first (each keeps the data and the optimizer state).
LADDER = ("bf16-moments", "bf16-weights", "checkpoint")


def _parse_bytes(value, what: str) -> Optional[int]:
    from .tune import parse_budget

    if value == 0:
        return 0
    try:
        return parse_budget(value)
    except (TypeError, ValueError) as exc:
        message = str(exc)  # (parse_budget speaks of the tuner's memory_budget)
        raise ValueError(message.replace("memory_budget", what) if "memory_budget" in message
                         else f"{what}: {message}") from None


def _state_bytes(amp) -> int:
    from .tune import _state_bytes as measure

    return sum(measure(amp._module, opt) for opt in amp.optimizers)


class _Move:
    def __init__(self, name: str, step: int, undo: Callable[[], object], freed: int):
        self.name, self.step, self.undo, self.freed = name, step, undo, freed


def _bf16_weights_policy(policy):
    """`policy` moved to bf16 weights (the "bf16-weights" move). The islands stay, with their fp32 weights
    (recipes.cast_matmul_weights keeps them)."""
    return policy.replace(param_dtype=torch.bfloat16, compute_dtype=torch.bfloat16, param_scope="matmul",
                          loss_scale=None)


class MemoryGuard:
    """Watches memory headroom and moves the controller to a lighter recipe (see the module docstring).

    Args:
        budget: bytes (or "20GiB") the run may use; None: the whole device.
        min_free: headroom (bytes or "2GiB") under which a move is made; default 5% of the
            budget (or of the device's memory), 0 where neither is known.
        check_every: steps between reads (a read costs a driver call, no sync).
        allow_recover: undo the last move when memory frees up.
        recover_after: steps the headroom must stay high before a move is undone.
        ladder: the moves to use, in order (a subset of LADDER).
        reader: ``reader() -> headroom bytes`` to use instead of the device's (tests, other devices).
        process_group: the ranks that move together (default: the controller's ``process_group`` if it has
            one, else every rank when torch.distributed runs with several); create the guard with the same
            arguments on every rank.
    """

    def __init__(self, budget=None, *, min_free=None, check_every: int = 10, allow_recover: bool = False,
                 recover_after: int = 200, ladder: Sequence[str] = LADDER,
                 reader: Optional[Callable[[], int]] = None, process_group=None):
        ladder = (ladder,) if isinstance(ladder, str) else tuple(ladder)  # one move by its name
        unknown = [m for m in ladder if m not in LADDER]
        if unknown:
            raise ValueError(f"ladder: unknown move(s) {unknown}; choose from {', '.join(LADDER)}")
        for name, value in (("check_every", check_every), ("recover_after", recover_after)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (steps), got {value!r}")
        self.budget = _parse_bytes(budget, "budget")
        self.min_free = _parse_bytes(min_free, "min_free")
        self.check_every = int(check_every)
        self.allow_recover = bool(allow_recover)
        self.recover_after = int(recover_after)
        self.ladder = tuple(ladder)
        if reader is not None and not callable(reader):
            raise TypeError(f"reader must be a callable returning the headroom in bytes, got {type(reader).__name__}")
        self.reader = reader
        self.process_group = process_group
        self.moves: List[_Move] = []
        self._high_since: Optional[int] = None

    # ------------------------------------------------------------ several processes
    def _group(self, amp):
        """The process group whose ranks move together, or None for one process."""
        if self.process_group is not None:
            return self.process_group
        group = getattr(amp, "process_group", None)
        if group is not None:
            return group
        return world_group()

    def _any(self, amp, flags: Sequence[bool]) -> List[bool]:
        """Per flag, whether it holds on some rank (one all-reduce; the flags as given for one process)."""
        group = self._group(amp)
        if group is None:
            return [bool(f) for f in flags]
        dist = torch.distributed
        # NCCL groups reduce CUDA tensors only.
        device = amp.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return [bool(v) for v in t.tolist()]

    # ------------------------------------------------------------ reading
    def headroom(self, amp) -> Optional[int]:
        """Bytes the run can still allocate, or None where it cannot be read."""
        if self.reader is not None:
            room = self.reader()
            if room is None:
                return None  # (the reader cannot tell now)
            if isinstance(room, bool) or not isinstance(room, (int, float)) or room != room:
                raise TypeError(f"MemoryGuard: reader() must return the headroom in bytes (a number, or None when "
                                f"it cannot tell), got {room!r}")
            return int(max(min(room, 2**62), -2**62))  # (an infinite headroom has no int)
        device = amp.device
        if device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        room = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if self.budget is not None:
            room = min(room, self.budget - torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)  # the next read sees the peak of its own window
        return int(room)

    def _threshold(self, amp) -> int:
        if self.min_free is not None:
            return self.min_free
        total = self.budget
        if total is None and amp.device.type == "cuda":
            total = torch.cuda.get_device_properties(amp.device).total_memory
        return int(0.05 * total) if total else 0

    # ------------------------------------------------------------ hooks the controller calls
    def after_step(self, amp) -> None:
        """Called by the controller after every step: every ``check_every`` steps, read the headroom and make
        the next move when it is under ``min_free`` (or undo the last one, with ``allow_recover``)."""
        step = amp.step_count
        if step % self.check_every:
            return
        room = self.headroom(amp)
        low = self._threshold(amp)
        need = 2 * low + 2 * self.moves[-1].freed if self.moves else None
        # Decided together (every rank reaches each check at the same step): a rank under min_free moves
        # every rank; moving back needs the headroom on every rank. A rank that cannot read its headroom
        # neither asks for a move nor vouches for moving back.
        pressed, short = self._any(amp, [room is not None and room < low,
                                         room is None or need is None or room < need])
        if pressed:
            self._high_since = None
            self.lighter(amp, f"memory headroom {_gib(room)} under min_free {_gib(low)}"
                         if room is not None and room < low else
                         f"memory headroom under min_free {_gib(low)} on another rank")
            return
        if not (self.allow_recover and self.moves):
            return
        if short:
            self._high_since = None
            return
        if self._high_since is None:
            self._high_since = step
        if step - self._high_since >= self.recover_after and step - self.moves[-1].step >= self.recover_after:
            self.heavier(amp, f"memory headroom {_gib(room)} at or above {_gib(need)} for "
                              f"{step - self._high_since} steps")
            self._high_since = None

    def on_oom(self, amp, what: str) -> bool:
        """After an out-of-memory error (its partial step already dropped): make the next move. False when
        no move is left."""
        return self.lighter(amp, f"out of memory ({what})")

    # ------------------------------------------------------------ moves
    def lighter(self, amp, reason: str) -> bool:
        """Make the next move of the ladder that can be made here (an event for each one that cannot); False
        when none is left."""
        done = {m.name for m in self.moves}
        for name in self.ladder:
            if name in done:
                continue
            why_not = self._why_not(amp, name)
            if why_not:
                amp.events.append(Event(amp.step_count, "memory_pressure", f"{reason}; cannot use {name}: {why_not}",
                                        data={"move": name, "applied": False}))
                done.add(name)
                continue
            before = _state_bytes(amp)
            undo = getattr(self, "_" + name.replace("-", "_"))(amp, reason)
            gc.collect()
            if amp.device.type == "cuda":
                torch.cuda.empty_cache()
            freed = max(0, before - _state_bytes(amp))
            self.moves.append(_Move(name, amp.step_count, undo, freed))
            return True
        return False

    def heavier(self, amp, reason: str) -> bool:
        """Undo the last move (event ``"memory_recovered"``); False when no move was made."""
        if not self.moves:
            return False
        move = self.moves.pop()
        policy = move.undo()
        message = f"{reason}; {move.name} undone"
        if policy is not None:
            amp._decide("memory_recovered", message, policy.replace(reasons=amp.policy.reasons), move=move.name)
        else:
            amp.events.append(Event(amp.step_count, "memory_recovered", message, data={"move": move.name}))
        return True

    def _why_not(self, amp, name: str) -> Optional[str]:
        from . import optim

        if name in ("bf16-moments", "bf16-weights"):
            if name == "bf16-weights" and amp.policy.param_dtype == torch.bfloat16:
                return "the parameters are already bfloat16"
            if name == "bf16-weights" and amp.device.type == "cuda" and not amp.capabilities.bf16:
                return f"bf16 is not native on {amp.capabilities.name}"
            if name == "bf16-weights":
                why = cast_refusal(amp.model, _bf16_weights_policy(amp.policy))
                if why:
                    return why
            for i, opt in enumerate(amp.optimizers):
                if name == "bf16-moments" and isinstance(opt, (optim.AdamW, optim.SGD)) and all(
                        g["moment_dtype"] == torch.bfloat16 for g in opt.param_groups):
                    return "the optimizer's moments are already bfloat16"
                why = convertible(opt)
                if why:
                    return f"optimizers[{i}]: {why}"
        if name == "checkpoint":
            if not find_blocks(amp.model):
                return "the model has no repeated blocks (an nn.ModuleList of one class)"
        return None

    def _convert(self, amp, moment_dtype):
        swaps = [convert_optimizer_in_place(opt, moment_dtype) for opt in amp.optimizers]

        def undo():
            for back in reversed(swaps):
                back()
        return undo

    def _bf16_moments(self, amp, reason):
        undo = self._convert(amp, torch.bfloat16)
        amp.events.append(Event(amp.step_count, "memory_pressure", f"{reason}; optimizer moments now bfloat16 "
                                "(adaptive_amp.optim with stochastic rounding)", data={"move": "bf16-moments"}))
        return undo

    def _bf16_weights(self, amp, reason):
        from . import optim

        undo_opt = None
        if not all(isinstance(o, (optim.AdamW, optim.SGD)) and all(g.get("stochastic_rounding") for g in
                                                                     o.param_groups) for o in amp.optimizers):
            undo_opt = self._convert(amp, torch.float32)
        old_policy, old_scaler = amp.policy, amp.scaler
        policy = _bf16_weights_policy(old_policy)
        undo_cast = cast_for_policy(amp.model, policy)
        # The controller's hooks for this policy (embeddings return fp32); amp.remove() removes them with its own.
        old_hooks, amp._policy_hooks = amp._policy_hooks, amp._owned.add(policy_hooks(amp.model, policy))
        amp._decide("memory_pressure", f"{reason}; the matmul layers' weights now bfloat16 with stochastic rounding, "
                    f"compute under bf16 autocast (was params={dtype_name(old_policy.param_dtype)}, "
                    f"compute={dtype_name(old_policy.compute_dtype)})", policy, move="bf16-weights")
        amp.scaler = amp._make_scaler(policy)

        def undo():
            if amp._policy_hooks is not None:
                amp._owned.discard(amp._policy_hooks)
                amp._policy_hooks.remove()
            amp._policy_hooks = old_hooks
            undo_cast()
            amp.scaler = old_scaler
            if undo_opt is not None:
                undo_opt()
            return old_policy  # heavier() sets it, with the event
        return undo

    def _checkpoint(self, amp, reason):
        # Owned by the controller too, so that its remove() (or its collection) takes the checkpointing off.
        undo = amp._owned.add(checkpoint_blocks(amp.model)).remove
        amp.events.append(Event(amp.step_count, "memory_pressure", f"{reason}; the model's blocks now recompute "
                                "their activations in backward (activation checkpointing)",
                                data={"move": "checkpoint"}))
        return undo


def train_step(amp, closure: Callable[[], torch.Tensor], max_grad_norm=None, norm_type: float = 2.0):
    """One whole step: ``loss = closure()`` under the policy's autocast, backward, step, and the gradients
    cleared (``zero_grad(set_to_none=True)``: the next call starts from none). An out-of-memory error
    in the forward or backward drops the partial step (gradients, recorded loss), lets the memory guard make
    the recipe lighter, and runs the closure again on the same data; without a guard, or with no move left,
    the error is raised. One in the optimizer step is raised (see below). Returns the detached loss."""
    guard = getattr(amp, "memory_guard", None)
    while True:
        what = None
        try:
            with amp.autocast():
                loss = closure()
            amp.backward(loss)
        except torch.OutOfMemoryError as exc:
            what = f"step {amp.step_count}, forward/backward: {str(exc).splitlines()[0][:200]}"
        if guard is not None and guard._group(amp) is not None:
            # Every rank reaches this point once a pass, out of memory or not: they rerun together.
            (anywhere,) = guard._any(amp, [what is not None])
            if anywhere and what is None:
                what = f"step {amp.step_count}, forward/backward: another rank ran out of memory"
        if what is None:
            break
        # Outside the except block: the traceback (and the activations its frames hold) is gone.
        loss = None
        amp.zero_grad(set_to_none=True)
        amp._drop_partial_step()
        gc.collect()
        if amp.device.type == "cuda":
            torch.cuda.empty_cache()
        if guard is None or not guard.on_oom(amp, what):
            raise torch.OutOfMemoryError(f"{what}; " + ("no memory guard (pass memory_guard=MemoryGuard(...) to "
                                         "AdaptiveMixedPrecision to move to a lighter recipe instead)"
                                         if guard is None else "no lighter recipe is left (moves made: " +
                                         ", ".join(m.name for m in guard.moves) + ")"))
    try:
        amp.step(max_grad_norm=max_grad_norm, norm_type=norm_type)
    except torch.OutOfMemoryError as exc:
        # Not retried: an optimizer may have updated part of its state (moments, step counts) before the
        # allocation that failed, and a second step would apply that part twice.
        raise torch.OutOfMemoryError(f"step {amp.step_count}: the optimizer step ran out of memory ({exc}); it is "
                                     "not retried, since its state may be partly updated. Let a MemoryGuard move "
                                     "before it happens (a larger min_free, a smaller check_every), or make room "
                                     "for the optimizer state") from None
    # Cleared here, not left to the caller: a whole step that kept its gradients would add them into the next
    # one's (measured on the H200: GPT-2 medium and Llama 1B then diverged, loss 11 -> 18-30 in 2000 steps).
    amp.zero_grad(set_to_none=True)
    return loss.detach()


def _gib(n: int) -> str:
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n} B"
