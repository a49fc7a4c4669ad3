"""Fused optimizers for pure-bf16 training: AdamW and SGD with stochastic rounding.

With bf16 parameters and no fp32 master copy, an update smaller than half a
bf16 ulp of the weight is lost by round-to-nearest, so small learning rates
stall. These optimizers do the step in fp32 (moments in fp32, or bf16) and
write the parameters back with stochastic rounding (csrc/optim.h states the
contract): the expected weight is the fp32 weight, at 2 bytes a parameter.

* :class:`AdamW`, :class:`SGD`: ``torch.optim`` subclasses with torch's
  argument names, defaults and ``state_dict`` layout (a checkpoint of
  ``torch.optim.AdamW`` loads), plus ``stochastic_rounding``,
  ``moment_dtype`` and ``generator``. One native launch per param group and
  device; fp32 parameters take the same kernel with plain fp32 stores.
* ``_step_supports_amp_scaling``: with :class:`adaptive_amp.GradScaler` or
  ``torch.amp.GradScaler`` the step unscales by ``grad_scale`` and skips
  itself when ``found_inf`` is set, on the device: no host synchronization,
  and the step can be captured in a CUDA graph.
* ``track_grad_norm``: the step also measures the L2 norm of the gradients
  it reads (``last_grad_norm``, a device tensor): a training loop's
  gradient norm without a second pass over every gradient.
* :func:`adamw_step_`, :func:`sgd_step_`: the functional ops, twins of
  ``adaptive_amp.reference.adamw_step_`` / ``sgd_step_``.
"""

from __future__ import annotations

import numbers
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from . import _C, _native
from ._native import BFLOAT16, FLOAT32
from .layers import is_sharded

_PARAM_DTYPES = (FLOAT32, BFLOAT16)
_MOMENT_DTYPES = {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16}
_ADAMW, _SGD = 0, 1
_I64_LIMIT = 1 << 63
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: int) -> int:
    if device == _native.CPU:
        return 0
    return _raw_stream(device) if _raw_stream is not None else _native.current_stream("torch", device)


def _u64(v: int) -> int:
    return v + (1 << 64) if v < 0 else v


def _describe(xs, name, dtypes):
    # Dense permuted layouts (channels_last) as they are: the step is elementwise over memory, and _common
    # checks that each param's grad and buffers share its layout.
    return _native.describe_many(xs, name, writable=False, dtypes=dtypes, dense=True)


def _device_scalar(t, name, device):
    """A 1-element float32 tensor of the params' device (moved there without a sync, as torch's fused step does)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}; pass a 1-element float32 tensor")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float32")
    if t.numel() != 1:
        raise ValueError(f"{name} has {t.numel()} elements; pass a 1-element float32 tensor")
    want = torch.device("cpu") if device == _native.CPU else torch.device("cuda", device)
    if t.device != want:
        t = t.to(want, non_blocking=True)
    return t.resolve_neg().contiguous()  # (a lazily negated view holds -t in memory; the core reads memory)


def _seed_offset(generator, seed, offset, device):
    """(seed, offset, seed_offset tensor or None): explicit numbers, or two draws on the device."""
    if seed is not None:
        if generator is not None:
            raise ValueError("generator and seed are both given; pass one")
        return int(seed) % (1 << 64), int(offset or 0) % (1 << 64), None
    if offset is not None:
        raise ValueError("offset is given without seed; pass seed too")
    where = "cpu" if device == _native.CPU else f"cuda:{device}"
    if generator is None:
        # Two 63-bit draws on the device: no host sync, and capturable.
        return 0, 0, torch.randint(0, _I64_LIMIT - 1, (2,), dtype=torch.int64, device=where)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator is a {type(generator).__name__}; pass a torch.Generator")
    if generator.device.type != torch.device(where).type:
        raise ValueError(f"generator is on {generator.device} but the params are on {where}; pass a generator of "
                         "the params' device")
    return 0, 0, torch.randint(0, _I64_LIMIT - 1, (2,), dtype=torch.int64, device=where, generator=generator)


def _common(params, grads, lists, names):
    """Describes every list; all of one device and as long as params. Returns (batches, device)."""
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"params is a {type(params).__name__}; pass a list of tensors")
    n = len(params)
    for xs, name in zip(lists, names):
        if len(xs) != n and not (name == "momentum_buffers" and not xs):  # none without momentum
            raise ValueError(f"{name} has {len(xs)} tensors; params has {n}")
    for i, (p, g) in enumerate(zip(params, grads)):
        if isinstance(g, Tensor) and g.layout != torch.strided:
            raise ValueError(f"grads[{i}] is a sparse gradient ({g.layout}); this optimizer needs dense gradients")
        if isinstance(p, Tensor) and p.is_complex():
            raise TypeError(f"params[{i}] has dtype {p.dtype}; complex parameters are not supported "
                            "(pass torch.view_as_real(p))")
        if isinstance(p, Tensor) and isinstance(g, Tensor) and g.shape != p.shape:
            raise ValueError(f"grads[{i}] has shape {tuple(g.shape)}; params[{i}] has shape {tuple(p.shape)}")
    for k, (xs, name) in enumerate(zip(lists, names)):
        if name in ("params", "steps"):
            continue
        for i, (p, m) in enumerate(zip(params, xs)):
            if not (isinstance(p, Tensor) and isinstance(m, Tensor)):
                continue
            # torch refuses a buffer of another shape (a broadcast error); so do we, by name, before the core
            # (which checks the element counts again) is called.
            if name != "grads" and m.shape != p.shape:
                raise ValueError(f"{name}[{i}] has {m.numel()} elements (shape {tuple(m.shape)}); params[{i}] has "
                                 f"{p.numel()} (shape {tuple(p.shape)}); pass buffers of the params' shapes")
            if p.numel() > 1 and m.stride() != p.stride() and not (p.is_contiguous() and m.is_contiguous()):
                # The step pairs elements by memory order: a channels_last param needs its grad and buffers
                # in the same layout (autograd and the optimizers' own state give exactly that).
                if name == "grads":  # read only: a copy in the param's layout
                    xs = lists[k] = list(xs) if not isinstance(xs, list) else xs
                    xs[i] = torch.empty_like(p, dtype=m.dtype).copy_(m)
                else:
                    raise ValueError(f"{name}[{i}] has strides {m.stride()}; params[{i}] has {p.stride()}; the "
                                     f"fused step needs one memory layout: pass {name}[{i}] in the param's layout "
                                     "(torch.empty_like(param).copy_(buffer))")
    batches = []
    device = None
    for k, (xs, name) in enumerate(zip(lists, names)):
        if name == "grads" and any(isinstance(g, Tensor) and g.is_neg() for g in xs):
            # torch's lazy negation (the memory holds -grad): read through a resolved copy, as torch's step would
            # read the negated values; the copy lives in lists (the caller's) until the launch.
            xs = lists[k] = [g.resolve_neg() if isinstance(g, Tensor) else g for g in xs]
        if not xs:
            batches.append(None)
            continue
        dtypes = (FLOAT32,) if name == "steps" else _PARAM_DTYPES
        b = _describe(xs, name, dtypes)
        if device is None:
            device = b.device
        elif b.device != device:
            raise ValueError(f"{name} are on {_native.device_name(b.device)} but params are on "
                             f"{_native.device_name(device)}; pass the tensors of one device per call")
        batches.append(b)
    return batches, device


def _needs_bits(batches, stochastic_rounding):
    return stochastic_rounding and any(b is not None and BFLOAT16 in b.dtypes for b in batches)


def _stats_buffers(numels, where: torch.device, workspace_bytes=None):
    """(grad_sumsq, workspace or None): this call's own output (one float32 per tensor) and, on CUDA, the
    workspace of its per-chunk partials. Allocations only, no launch."""
    sumsq = torch.empty(len(numels), dtype=torch.float32, device=where)
    if where.type == "cpu":
        return sumsq, None
    nbytes = _C.optim_workspace_bytes(list(numels)) if workspace_bytes is None else workspace_bytes
    return sumsq, torch.empty(max(nbytes, 1), dtype=torch.uint8, device=where)


def _stats_args(sumsq, workspace) -> dict:
    if sumsq is None:
        return {}
    return dict(grad_sumsq=sumsq.data_ptr(), grad_sumsq_count=sumsq.numel(),
                workspace=workspace.data_ptr() if workspace is not None else 0,
                workspace_bytes=workspace.numel() if workspace is not None else 0)


def _call(kind, batches, *, steps=(), steps_watch=(), first=(), lr, beta1=0.9, beta2=0.999, eps=1e-8, momentum=0.0,
          dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False, stochastic_rounding=True, grad_scale=None,
          found_inf=None, generator=None, seed=None, offset=None, grad_sumsq=False, device):
    pb, gb, mb, vb = batches
    grad_scale = _device_scalar(grad_scale, "grad_scale", device)
    found_inf = _device_scalar(found_inf, "found_inf", device)
    so = None
    s = o = 0
    if _needs_bits((pb, mb, vb), stochastic_rounding):
        s, o, so = _seed_offset(generator, seed, offset, device)
    where = torch.device("cpu") if device == _native.CPU else torch.device("cuda", device)
    sumsq, workspace = _stats_buffers(pb.numels, where) if grad_sumsq else (None, None)
    _C.optim_step(
        kind, pb.ptrs, pb.numels, pb.dtypes, gb.ptrs, gb.numels, gb.dtypes,
        mb.ptrs if mb else [], mb.numels if mb else [], mb.dtypes if mb else [],
        vb.ptrs if vb else [], vb.numels if vb else [], vb.dtypes if vb else [],
        list(steps), [bool(f) for f in first], float(lr), float(beta1), float(beta2), float(eps), float(momentum),
        float(dampening), bool(nesterov), float(weight_decay), bool(maximize), bool(stochastic_rounding),
        grad_scale.data_ptr() if grad_scale is not None else 0, found_inf.data_ptr() if found_inf is not None else 0,
        _u64(s), _u64(o), so.data_ptr() if so is not None else 0, device, _stream(device),
        # The launch reads these tensors' pointers again (another thread may have given one new memory).
        (pb.watch, gb.watch, mb.watch if mb else (), vb.watch if vb else (), steps_watch, grad_scale, found_inf,
         so), **_stats_args(sumsq, workspace))
    return sumsq


def _check_numbers(**kw):
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} is a {type(v).__name__}; pass a number")


def adamw_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, maximize: bool = False, stochastic_rounding: bool = True,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None, generator=None, seed=None,
                offset=None, grad_sumsq: bool = False) -> Optional[Tensor]:
    """One fused AdamW step over a list of one device (contract: csrc/optim.h).

    ``steps``: 1-element float32 tensors, the count of steps done so far; the
    step uses ``steps[k] + 1`` and leaves ``steps`` as they are (the caller
    increments them, as :class:`AdamW` does). Nothing is written when
    ``found_inf`` is nonzero. Random bits: from ``seed``/``offset``, else two
    draws of ``generator`` (torch's default generator of the device if None).
    With ``grad_sumsq=True`` returns a float32 tensor of the params' device, per tensor the sum of squares of
    the gradient the step used (after ``grad_scale``), measured in the same pass; NaN when the step was
    skipped. Else None.
    """
    _check_numbers(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    params = list(params)
    if not params:
        return torch.empty(0, dtype=torch.float32) if grad_sumsq else None
    batches, device = _common(params, grads, [params, list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps)],
                              ["params", "grads", "exp_avgs", "exp_avg_sqs", "steps"])
    for i, t in enumerate(steps):
        if t.numel() != 1:
            raise ValueError(f"steps[{i}] has {t.numel()} elements; pass a 1-element float32 tensor")
    return _call(_ADAMW, batches[:4], steps=batches[4].ptrs, steps_watch=batches[4].watch, lr=lr, beta1=beta1,
                 beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
                 stochastic_rounding=stochastic_rounding, grad_scale=grad_scale, found_inf=found_inf,
                 generator=generator, seed=seed, offset=offset, grad_sumsq=grad_sumsq, device=device)


def sgd_step_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
              first: Sequence[bool] = (), *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
              weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False,
              stochastic_rounding: bool = True, grad_scale: Optional[Tensor] = None,
              found_inf: Optional[Tensor] = None, generator=None, seed=None, offset=None,
              grad_sumsq: bool = False) -> Optional[Tensor]:
    """One fused SGD step (torch.optim.SGD's rule) over a list of one device (contract: csrc/optim.h).

    ``momentum_buffers``: one per param when ``momentum != 0`` (else empty);
    ``first[k]``: the buffer is new, so it becomes the gradient itself. ``grad_sumsq`` as in
    :func:`adamw_step_`.
    """
    _check_numbers(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    params = list(params)
    if not params:
        return torch.empty(0, dtype=torch.float32) if grad_sumsq else None
    bufs = list(momentum_buffers)
    batches, device = _common(params, grads, [params, list(grads), bufs], ["params", "grads", "momentum_buffers"])
    first = list(first) if bufs else []
    return _call(_SGD, batches + [None], first=first, lr=lr, momentum=momentum, dampening=dampening,
                 nesterov=nesterov, weight_decay=weight_decay, maximize=maximize,
                 stochastic_rounding=stochastic_rounding, grad_scale=grad_scale, found_inf=found_inf,
                 generator=generator, seed=seed, offset=offset, grad_sumsq=grad_sumsq, device=device)


# --------------------------------------------------------------------------- optimizers


def _check_moment_dtype(moment_dtype):
    if moment_dtype not in _MOMENT_DTYPES:
        raise TypeError(f"moment_dtype is {moment_dtype!r}; expected torch.float32 or torch.bfloat16")


def _check_lr(lr):
    if isinstance(lr, Tensor):
        raise TypeError("lr is a Tensor; pass a float (the fused step reads lr on the host)")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def _placement(t) -> str:
    return f"{tuple(t.placements)} on {t.device_mesh}" if is_sharded(t) else "a plain tensor"


def _global_sumsq(params, local: Tensor) -> Tensor:
    """Per param, the sum of squares of its whole gradient from `local` (each rank's shard's): summed over
    the mesh dimensions a param is sharded on (one all-reduce per mesh and placement), as is over the others."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    out = local.clone()
    by_layout: dict = {}
    for i, p in enumerate(params):
        if is_sharded(p):
            by_layout.setdefault((p.device_mesh, tuple(p.placements)), []).append(i)
    for (mesh, placements), index in by_layout.items():
        partial = [Partial() if isinstance(pl, Shard) else pl for pl in placements]
        rows = torch.tensor(index, device=local.device)
        out[rows] = DTensor.from_local(local[rows], mesh, partial, run_check=False).full_tensor()
    return out


def _by_device(params):
    groups = {}
    for p in params:
        groups.setdefault(p.device, []).append(p)
    return groups.items()


def _shared_steps(steps):
    """One float32 buffer whose elements are the given step counters, and its 0-dim views (in order).

    Counters that already are the elements of one buffer (a plan built before) keep it, so that a
    CUDA graph captured over a step goes on updating the tensors that ``state`` holds.
    """
    base = steps[0]._base
    if (base is not None and base.dim() == 1 and base.numel() == len(steps)
            and all(s._base is base and s.dim() == 0 and s.storage_offset() == i for i, s in enumerate(steps))):
        return base, steps
    buf = torch.cat([s.detach().reshape(1) for s in steps])
    return buf, list(buf.unbind(0))


class _DevicePlan:
    """One param group's params with gradients on one device: the native plan and what a step needs."""

    __slots__ = ("native", "params", "device", "steps", "bits", "where", "numels", "workspace_bytes")

    def __init__(self, native, params, device, steps, bits, numels):
        self.native = native
        self.params = params  # for the autograd version bump
        self.device = device  # _native device index
        self.steps = steps  # AdamW: the shared step buffer, else None
        self.bits = bits  # whether a launch draws random bits (SR to bf16 somewhere)
        self.where = torch.device("cpu") if device == _native.CPU else torch.device("cuda", device)
        self.numels = numels
        self.workspace_bytes = 0 if device == _native.CPU else _C.optim_workspace_bytes(list(numels))


def _norm_of(sums: List[Tensor]) -> Optional[Tensor]:
    """The L2 norm from per-tensor sums of squares (of one or several devices): on the first one's device."""
    if not sums:
        return None
    by_device: dict = {}
    for s in sums:
        by_device.setdefault(s.device, []).append(s)
    parts = [(torch.cat(ss) if len(ss) > 1 else ss[0]).sum() for ss in by_device.values()]
    first = sums[0].device
    total = parts[0] if len(parts) == 1 else torch.stack([p.to(first) for p in parts]).sum()
    return total.sqrt()


class _GroupPlan:
    """What one step of one param group reuses while it holds (see _C.OptimPlan for the checks)."""

    __slots__ = ("group", "state", "key", "devices", "absent", "first")

    def __init__(self, group, state, key, devices, absent, first):
        self.group = group
        self.first = first  # SGD: {param: True} for the momentum buffers created by the build
        self.state = state
        self.key = key  # what of the group's options the plan's lists depend on (SGD: whether momentum is used)
        self.devices = devices
        self.absent = absent  # a native plan that only checks that params without grads still have none

    def holds(self, group, state, key):
        if self.group is not group or self.state is not state or self.key != key:
            return False
        if self.absent is not None and not self.absent.collect():
            return False
        return all(d.native.collect() for d in self.devices)


class _Fused(torch.optim.Optimizer):
    """What AdamW and SGD share: option checks, state_dict loading, the GradScaler hand-over, and the
    cached per-group plans that keep the host work of a step small.

    A step of a group whose plan holds reads only the gradients (one C++ loop,
    _C.OptimPlan.collect) and launches once per device. The plan is built
    (every list validated as the functional ops do, state created) on the
    first step and again whenever anything it assumed changed: the group's
    param list or a param's storage, the optimizer's state (load_state_dict,
    a replaced moment or counter), which params have gradients, or a
    gradient's dtype, shape, device or layout. AdamW's ``state[p]["step"]``
    counters of a group and device are 0-dim views of one float32 buffer, so
    that one add moves them all (torch's convention and state_dict layout).
    """

    _step_supports_amp_scaling = True
    _moment_keys: tuple = ()
    _kind = _ADAMW
    track_grad_norm = False  # set per instance (the constructor's argument)
    # The last tracked step's per-tensor sums of squares (one tensor a device plan) and their norm, taken from
    # them when first asked for: a training loop that reads the norm later (the controller's monitor sums them
    # at its read) spares two launches a step.
    _grad_sums: Optional[List[Tensor]] = None
    _grad_norm: Optional[Tensor] = None

    @property
    def last_grad_norm(self) -> Optional[Tensor]:
        """The L2 norm of the gradients the last step with ``track_grad_norm`` used (see :meth:`step`)."""
        if self._grad_norm is None and self._grad_sums:
            self._grad_norm = _norm_of(self._grad_sums)
        return self._grad_norm

    def __setstate__(self, state):
        super().__setstate__(state)
        # A state_dict of torch's optimizer has no stochastic_rounding / moment_dtype: keep ours.
        for group in self.param_groups:
            for key in ("stochastic_rounding", "moment_dtype"):
                group.setdefault(key, self.defaults[key])

    def load_state_dict(self, state_dict):
        """torch's loading, except that moments keep ``moment_dtype`` (torch would cast them to the
        params' dtype, rounding fp32 moments of bf16 params) and ``step`` becomes a float32 tensor of
        the param's device (as torch's fused optimizers keep it)."""
        saved = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        dtype_of = {id(p): g["moment_dtype"] for g in self.param_groups for p in g["params"]}
        for old, p in zip(saved_ids, params):
            if old not in saved or p not in self.state:
                continue
            st = self.state[p]
            for key in self._moment_keys:
                value = saved[old].get(key)
                if isinstance(value, Tensor):
                    if value.shape == p.shape:  # in the param's memory layout (a contiguous checkpoint of a
                        st[key] = torch.empty_like(p, dtype=dtype_of[id(p)]).copy_(value.detach())  # channels_last net)
                    else:  # (refused by name at the next step)
                        st[key] = value.detach().to(device=p.device, dtype=dtype_of[id(p)], copy=True)
            if "step" in st:
                step = st["step"]
                step = step if isinstance(step, Tensor) else torch.tensor(float(step))
                st["step"] = step.detach().to(device=p.device, dtype=torch.float32, copy=True).reshape(())
        self._plans = {}

    def _scaler_tensors(self):
        return getattr(self, "grad_scale", None), getattr(self, "found_inf", None)

    @staticmethod
    def _params_with_grad(group, name):
        out = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"{name} does not support sparse gradients; use torch.optim.SparseAdam")
            if torch.is_complex(p):
                raise TypeError(f"params: {name} does not support complex parameters (dtype {p.dtype})")
            out.append(p)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every param group (skipped on the device when a GradScaler handed a found_inf).

        With ``track_grad_norm``, ``last_grad_norm`` becomes the L2 norm of every gradient the step used
        (after the GradScaler's unscale), measured by the step's own pass: a 0-dim float32 tensor of the
        first gradient's device, read without a sync; NaN when the step was skipped, None when no param had
        a gradient. It is summed from the step's per-tensor sums of squares when first read (two small launches
        on the current stream)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = self._scaler_tensors()
        sums: Optional[List[Tensor]] = [] if self.track_grad_norm else None
        for group in self.param_groups:
            _check_lr(group["lr"])
            self._step_group(group, self._hyper(group), grad_scale, found_inf, sums)
        if sums is not None:
            self._grad_sums, self._grad_norm = sums, None
        return loss

    @staticmethod
    def _hyper(group) -> tuple:
        """(lr, beta1, beta2, eps, momentum, dampening, nesterov, weight_decay, maximize, stochastic_rounding)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- plans
    @staticmethod
    def _plan_key(group):
        """The group settings a plan depends on besides its tensors (a change rebuilds it): whether
        launches draw random bits."""
        return bool(group["stochastic_rounding"])

    def _init_state(self, group, params):
        """Creates missing state; returns {param: True} for SGD buffers created now."""
        raise NotImplementedError

    def _lists(self, group, ps):
        """(lists, names, keys) for the functional validation and the plan of params ps."""
        raise NotImplementedError

    def _build_plan(self, group):
        """Validates the group's lists as the functional ops do (raising before anything is written),
        creates missing state and returns a plan, or None when a plan cannot describe the group."""
        name = type(self).__name__
        with_grad = self._params_with_grad(group, name)
        for p in with_grad:  # before any state is created in its layout (the state would then be blamed)
            if not _native._dense_layout(p):
                raise ValueError(f"{self._param_name(group, p)} is not dense in memory (a transposed or sliced view: "
                                 f"shape {tuple(p.shape)}, strides {p.stride()}): {name}'s fused step updates each "
                                 "param in place as one block of memory, contiguous or channels_last. Give the "
                                 "parameter such memory where the model is built (nn.Parameter(w.contiguous()))")
        first = self._init_state(group, with_grad)
        index = {id(p): i for i, p in enumerate(group["params"])}
        absent = [i for i, p in enumerate(group["params"]) if p.grad is None]
        devices = []
        for _, ps in _by_device(with_grad):
            self._check_state(group, ps)
            lists, names, keys = self._lists(group, ps)
            batches, device = _common(ps, lists[1], lists, names)
            if self._kind == _ADAMW:
                for i, t in enumerate(lists[4]):
                    if t.numel() != 1:
                        raise ValueError(f"steps[{i}] has {t.numel()} elements; pass a 1-element float32 tensor")
                buf, views = _shared_steps(lists[4])
                for p, v in zip(ps, views):
                    self.state[p]["step"] = v
                step_ptrs = [buf.data_ptr() + 4 * i for i in range(len(ps))]
            else:
                buf, step_ptrs = None, []
            pb, _, mb, vb = (batches + [None])[:4]
            states = [self.state[p] for p in ps]
            values = [st[k] for st in states for k in keys]
            value_ptrs = [v.data_ptr() if k != "step" else 0 for st in states for k, v in
                          ((k, st[k]) for k in keys)]
            flags = [bool(first.get(p, False)) for p in ps] if mb is not None and self._kind == _SGD else []
            native = _C.OptimPlan(self._kind, group["params"], [index[id(p)] for p in ps], [], list(ps), pb.ptrs,
                                  pb.numels, pb.dtypes, [p.shape for p in ps], [p.dtype for p in ps], self.state,
                                  states, list(keys), values, value_ptrs, mb.ptrs if mb else [],
                                  mb.numels if mb else [], mb.dtypes if mb else [], vb.ptrs if vb else [],
                                  vb.numels if vb else [], vb.dtypes if vb else [], step_ptrs, flags, device)
            bits = group["stochastic_rounding"] and _needs_bits((pb, mb, vb), True)
            devices.append(_DevicePlan(native, list(ps), device, buf, bits, list(pb.numels)))
        absent_plan = None
        if absent:
            absent_plan = _C.OptimPlan(self._kind, group["params"], [], absent, [], [], [], [], [], [], {}, [], [],
                                       [], [], [], [], [], [], [], [], [], [], _native.CPU)
        return _GroupPlan(group, self.state, self._plan_key(group), devices, absent_plan, first)

    def _check_state(self, group, ps):
        """torch-like errors, naming the param and the state key, for a moment the step cannot use as the
        param's buffer (a checkpoint of a resized layer, a buffer replaced or resized by hand). The core
        checks the sizes again; this says which param and key, before anything is written."""
        for p in ps:
            for key in self._moment_keys:
                value = self.state[p].get(key)
                if value is None:
                    continue
                where = self._param_name(group, p)
                name = f"state['{key}'] of {where}"
                fix = f"reset it (del optimizer.state[{where}]) or load a state_dict saved for this model"
                if not isinstance(value, Tensor):
                    raise TypeError(f"{name} is a {type(value).__name__}; expected a tensor; {fix}")
                if value.shape != p.shape:
                    raise ValueError(f"{name} has {value.numel()} elements (shape {tuple(value.shape)}); the param "
                                     f"has {p.numel()} (shape {tuple(p.shape)}); {fix}")
                if value.device != p.device:
                    raise ValueError(f"{name} is on {value.device}; the param is on {p.device}; {fix}")
                if value.dtype not in _MOMENT_DTYPES:
                    raise TypeError(f"{name} has dtype {value.dtype}; expected torch.float32 or torch.bfloat16")
                same_layout = value.stride() == p.stride() or (value.is_contiguous() and p.is_contiguous())
                if not same_layout or value.is_neg() or value.is_conj():
                    raise ValueError(f"{name} is not laid out like the param (strides {value.stride()} vs "
                                     f"{p.stride()}, or lazily negated); the fused step writes it in the param's "
                                     f"memory layout (contiguous, or channels_last like the param): replace it with "
                                     f"torch.empty_like(param).copy_({name})")

    def _param_name(self, group, p):
        i = next(i for i, q in enumerate(group["params"]) if q is p)
        if len(self.param_groups) == 1:
            return f"params[{i}]"
        g = next(j for j, h in enumerate(self.param_groups) if h is group)
        return f"param_groups[{g}]['params'][{i}]"

    def _launch(self, plan, group, hyper, grad_scale, found_inf, sums):
        for dp in plan.devices:
            device = dp.device
            gs = _device_scalar(grad_scale, "grad_scale", device)
            fi = _device_scalar(found_inf, "found_inf", device)
            so = _seed_offset(self.generator, None, None, device)[2] if dp.bits else None
            sumsq, workspace = _stats_buffers(dp.numels, dp.where, dp.workspace_bytes) if sums is not None \
                else (None, None)
            dp.native.launch(*hyper, gs.data_ptr() if gs is not None else 0, fi.data_ptr() if fi is not None else 0,
                             0, 0, so.data_ptr() if so is not None else 0, _stream(device), (gs, fi, so),
                             **_stats_args(sumsq, workspace))
            if sumsq is not None:
                sums.append(sumsq)
            if dp.steps is not None:
                # torch's convention: the count moves on unless the step was skipped (on the device).
                dp.steps.add_(1)
                if fi is not None:
                    dp.steps.sub_(fi.reshape(()))
            torch.autograd.graph.increment_version(dp.params)

    def _step_group(self, group, hyper, grad_scale, found_inf, sums=None):
        plans = self.__dict__.get("_plans")
        if plans is None:
            plans = self._plans = {}
        plan = plans.get(id(group))
        key = self._plan_key(group)
        if plan is None or not plan.holds(group, self.state, key):
            plans.pop(id(group), None)
            # (Checked only without a plan that holds: a plan is never built for DTensor params.)
            if any(is_sharded(p) for p in group["params"]):
                return self._sharded_step(group, hyper, grad_scale, found_inf, sums)
            plan = self._build_plan(group)
            if not plan.holds(group, self.state, key):
                # What only the core checks (a gradient of another dtype than its param, say): the
                # functional op names it, or does the step; the plan is built again next time.
                return self._functional_step(group, plan.first, hyper, grad_scale, found_inf, sums)
            plans[id(group)] = plan
        self._launch(plan, group, hyper, grad_scale, found_inf, sums)

    def _sharded_step(self, group, hyper, grad_scale, found_inf, sums=None):
        """A step of a group with DTensor params (FSDP2's fully_shard): each rank steps its own shards through
        the functional op (the update is elementwise), the state DTensors sharded as the params are (what
        torch's optimizers keep, and torch.distributed.checkpoint saves). The gradient norm, when tracked, is
        the global one: the shards' sums of squares are reduced over each param's mesh."""
        name = type(self).__name__
        ps = self._params_with_grad(group, name)
        for p in ps:  # (before anything is written)
            if is_sharded(p) != is_sharded(p.grad) or \
                    (is_sharded(p) and (p.grad.placements != p.placements or p.grad.device_mesh != p.device_mesh)):
                raise ValueError(f"{self._param_name(group, p)} is sharded as {_placement(p)} but its gradient as "
                                 f"{_placement(p.grad)}: {name} steps each rank's shard of both, so they must be "
                                 "sharded alike (as fully_shard's reduce-scatter leaves them)")
        first = self._init_state(group, ps)
        local = [] if sums is not None else None
        self._functional_step(group, first, hyper, grad_scale, found_inf, local, shards=True)
        if sums is not None and local:  # (the functional step's sums: per device, in _by_device's order)
            sums.append(_global_sumsq([p for _, on in _by_device(ps) for p in on], torch.cat(local)))

    def _functional_step(self, group, first, hyper, grad_scale, found_inf, sums=None, shards=False):
        lr, beta1, beta2, eps, momentum, dampening, nesterov, weight_decay, maximize, sr = hyper
        for _, ps in _by_device(self._params_with_grad(group, type(self).__name__)):
            lists, _, _ = self._lists(group, ps)
            if shards:  # each rank's own part of every DTensor (a view: the step writes the params' shards)
                lists = [[t.to_local() if is_sharded(t) else t for t in xs] for xs in lists]
            common = dict(lr=lr, weight_decay=weight_decay, maximize=maximize, stochastic_rounding=sr,
                          grad_scale=grad_scale, found_inf=found_inf, generator=self.generator,
                          grad_sumsq=sums is not None)
            if self._kind == _ADAMW:
                sumsq = adamw_step_(*lists, beta1=beta1, beta2=beta2, eps=eps, **common)
                steps = lists[4]
                torch._foreach_add_(steps, 1)
                if found_inf is not None:
                    torch._foreach_sub_(steps, [found_inf.to(steps[0].device, non_blocking=True).reshape(())]
                                        * len(steps))
            else:
                flags = [bool(first.get(p, False)) for p in ps] if lists[2] else []
                sumsq = sgd_step_(*lists, flags, momentum=momentum, dampening=dampening, nesterov=nesterov,
                                  **common)
            if sumsq is not None:
                sums.append(sumsq)
            torch.autograd.graph.increment_version(ps)


class AdamW(_Fused):
    """AdamW in one fused native step per param group and device, bf16 params with stochastic rounding.

    Arguments and defaults as ``torch.optim.AdamW``; beyond them:
    ``stochastic_rounding`` (bf16 params and moments are written with
    stochastic rounding; False: round to nearest), ``moment_dtype``
    (``torch.float32`` or ``torch.bfloat16``), ``generator`` (the source of
    the random bits; torch's default generator of the device if None) and
    ``track_grad_norm`` (each step sets ``last_grad_norm``, the norm of the
    gradients it read; see :meth:`step`).
    ``amsgrad``, ``differentiable`` and a Tensor ``lr`` are refused;
    ``foreach``, ``capturable`` and ``fused`` are accepted and have no effect
    (the step is always fused and capturable). FSDP2's sharded (DTensor)
    parameters are stepped shard by shard, their state sharded alike, and
    ``last_grad_norm`` is the whole model's.
    """

    _moment_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 stochastic_rounding=True, moment_dtype=torch.float32, generator=None, track_grad_norm=False):
        _check_lr(lr)
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by adaptive_amp.optim.AdamW; use torch.optim.AdamW")
        if differentiable:
            raise ValueError("differentiable=True is not supported by adaptive_amp.optim.AdamW (a fused step)")
        _check_moment_dtype(moment_dtype)
        self.generator = generator
        self.track_grad_norm = bool(track_grad_norm)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=False, fused=fused,
                        decoupled_weight_decay=True, stochastic_rounding=stochastic_rounding,
                        moment_dtype=moment_dtype)
        super().__init__(params, defaults)

    def _init_state(self, group, params):
        for p in params:
            st = self.state[p]
            if len(st) == 0:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, dtype=group["moment_dtype"], memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=group["moment_dtype"],
                                                    memory_format=torch.preserve_format)
        return {}

    def _lists(self, group, ps):
        states = [self.state[p] for p in ps]
        lists = [list(ps), [p.grad for p in ps], [st["exp_avg"] for st in states],
                 [st["exp_avg_sq"] for st in states], [st["step"] for st in states]]
        return lists, ["params", "grads", "exp_avgs", "exp_avg_sqs", "steps"], ("step", "exp_avg", "exp_avg_sq")

    @staticmethod
    def _hyper(group) -> tuple:
        if group.get("amsgrad"):
            raise ValueError("amsgrad=True is not supported by adaptive_amp.optim.AdamW")
        beta1, beta2 = group["betas"]
        return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), 0.0, 0.0, False,
                float(group["weight_decay"]), bool(group["maximize"]), bool(group["stochastic_rounding"]))


class SGD(_Fused):
    """SGD (momentum, dampening, Nesterov, weight decay, maximize) in one fused native step per param group
    and device; bf16 params written with stochastic rounding. Arguments and defaults as ``torch.optim.SGD``
    plus ``stochastic_rounding``, ``moment_dtype``, ``generator`` and ``track_grad_norm`` (see :class:`AdamW`).

    A step skipped for ``found_inf`` leaves a new momentum buffer at zero, and
    the next step treats it as not new: ``momentum * 0 + (1 - dampening) * g``,
    which is ``g`` (torch's first-step value) when dampening is 0 (the default).
    """

    _moment_keys = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, stochastic_rounding=True,
                 moment_dtype=torch.float32, generator=None, track_grad_norm=False):
        _check_lr(lr)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if differentiable:
            raise ValueError("differentiable=True is not supported by adaptive_amp.optim.SGD (a fused step)")
        _check_moment_dtype(moment_dtype)
        self.generator = generator
        self.track_grad_norm = bool(track_grad_norm)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=False, fused=fused,
                        stochastic_rounding=stochastic_rounding, moment_dtype=moment_dtype)
        super().__init__(params, defaults)

    _kind = _SGD

    @staticmethod
    def _plan_key(group):
        return bool(group["stochastic_rounding"]), group["momentum"] != 0

    def _init_state(self, group, params):
        first = {}
        if group["momentum"] != 0:
            for p in params:
                st = self.state[p]
                if st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(p, dtype=group["moment_dtype"],
                                                             memory_format=torch.preserve_format)
                    first[p] = True
        return first

    def _lists(self, group, ps):
        if group["momentum"] != 0:
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            return [list(ps), [p.grad for p in ps], bufs], ["params", "grads", "momentum_buffers"], \
                ("momentum_buffer",)
        return [list(ps), [p.grad for p in ps], []], ["params", "grads", "momentum_buffers"], ()

    @staticmethod
    def _hyper(group) -> tuple:
        return (float(group["lr"]), 0.0, 0.0, 0.0, float(group["momentum"]), float(group["dampening"]),
                bool(group["nesterov"]), float(group["weight_decay"]), bool(group["maximize"]),
                bool(group["stochastic_rounding"]))


__all__: List[str] = ["AdamW", "SGD", "adamw_step_", "sgd_step_"]
