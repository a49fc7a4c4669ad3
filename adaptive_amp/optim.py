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
    batch = _native.describe_many(list(xs), name, writable=False, dtypes=dtypes)
    return batch


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
    return t.contiguous()


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
    batches = []
    device = None
    for xs, name in zip(lists, names):
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


def _call(kind, batches, *, steps=(), first=(), lr, beta1=0.9, beta2=0.999, eps=1e-8, momentum=0.0, dampening=0.0,
          nesterov=False, weight_decay=0.0, maximize=False, stochastic_rounding=True, grad_scale=None,
          found_inf=None, generator=None, seed=None, offset=None, device):
    pb, gb, mb, vb = batches
    grad_scale = _device_scalar(grad_scale, "grad_scale", device)
    found_inf = _device_scalar(found_inf, "found_inf", device)
    so = None
    s = o = 0
    if _needs_bits((pb, mb, vb), stochastic_rounding):
        s, o, so = _seed_offset(generator, seed, offset, device)
    _C.optim_step(
        kind, pb.ptrs, pb.numels, pb.dtypes, gb.ptrs, gb.numels, gb.dtypes,
        mb.ptrs if mb else [], mb.numels if mb else [], mb.dtypes if mb else [],
        vb.ptrs if vb else [], vb.numels if vb else [], vb.dtypes if vb else [],
        list(steps), [bool(f) for f in first], float(lr), float(beta1), float(beta2), float(eps), float(momentum),
        float(dampening), bool(nesterov), float(weight_decay), bool(maximize), bool(stochastic_rounding),
        grad_scale.data_ptr() if grad_scale is not None else 0, found_inf.data_ptr() if found_inf is not None else 0,
        _u64(s), _u64(o), so.data_ptr() if so is not None else 0, device, _stream(device))
    return so  # kept alive by the caller until the launch is enqueued (it is, on return)


def _check_numbers(**kw):
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} is a {type(v).__name__}; pass a number")


def adamw_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, maximize: bool = False, stochastic_rounding: bool = True,
                grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None, generator=None, seed=None,
                offset=None) -> None:
    """One fused AdamW step over a list of one device (contract: csrc/optim.h).

    ``steps``: 1-element float32 tensors, the count of steps done so far; the
    step uses ``steps[k] + 1`` and leaves ``steps`` as they are (the caller
    increments them, as :class:`AdamW` does). Nothing is written when
    ``found_inf`` is nonzero. Random bits: from ``seed``/``offset``, else two
    draws of ``generator`` (torch's default generator of the device if None).
    """
    _check_numbers(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    params = list(params)
    if not params:
        return
    batches, device = _common(params, grads, [params, list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps)],
                              ["params", "grads", "exp_avgs", "exp_avg_sqs", "steps"])
    for i, t in enumerate(steps):
        if t.numel() != 1:
            raise ValueError(f"steps[{i}] has {t.numel()} elements; pass a 1-element float32 tensor")
    _call(_ADAMW, batches[:4], steps=batches[4].ptrs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
          weight_decay=weight_decay, maximize=maximize, stochastic_rounding=stochastic_rounding,
          grad_scale=grad_scale, found_inf=found_inf, generator=generator, seed=seed, offset=offset, device=device)


def sgd_step_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
              first: Sequence[bool] = (), *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
              weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False,
              stochastic_rounding: bool = True, grad_scale: Optional[Tensor] = None,
              found_inf: Optional[Tensor] = None, generator=None, seed=None, offset=None) -> None:
    """One fused SGD step (torch.optim.SGD's rule) over a list of one device (contract: csrc/optim.h).

    ``momentum_buffers``: one per param when ``momentum != 0`` (else empty);
    ``first[k]``: the buffer is new, so it becomes the gradient itself.
    """
    _check_numbers(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    params = list(params)
    if not params:
        return
    bufs = list(momentum_buffers)
    batches, device = _common(params, grads, [params, list(grads), bufs], ["params", "grads", "momentum_buffers"])
    first = list(first) if bufs else []
    _call(_SGD, batches + [None], first=first, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
          weight_decay=weight_decay, maximize=maximize, stochastic_rounding=stochastic_rounding,
          grad_scale=grad_scale, found_inf=found_inf, generator=generator, seed=seed, offset=offset, device=device)


# --------------------------------------------------------------------------- optimizers


def _check_moment_dtype(moment_dtype):
    if moment_dtype not in _MOMENT_DTYPES:
        raise TypeError(f"moment_dtype is {moment_dtype!r}; expected torch.float32 or torch.bfloat16")


def _check_lr(lr):
    if isinstance(lr, Tensor):
        raise TypeError("lr is a Tensor; pass a float (the fused step reads lr on the host)")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def _by_device(params):
    groups = {}
    for p in params:
        groups.setdefault(p.device, []).append(p)
    return groups.items()


class _Fused(torch.optim.Optimizer):
    """What AdamW and SGD share: option checks, state_dict loading, the GradScaler hand-over."""

    _step_supports_amp_scaling = True
    _moment_keys: tuple = ()

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
                    st[key] = value.detach().to(device=p.device, dtype=dtype_of[id(p)], copy=True)
            if "step" in st:
                step = st["step"]
                step = step if isinstance(step, Tensor) else torch.tensor(float(step))
                st["step"] = step.detach().to(device=p.device, dtype=torch.float32, copy=True).reshape(())

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


class AdamW(_Fused):
    """AdamW in one fused native step per param group and device, bf16 params with stochastic rounding.

    Arguments and defaults as ``torch.optim.AdamW``; beyond them:
    ``stochastic_rounding`` (bf16 params and moments are written with
    stochastic rounding; False: round to nearest), ``moment_dtype``
    (``torch.float32`` or ``torch.bfloat16``) and ``generator`` (the source of
    the random bits; torch's default generator of the device if None).
    ``amsgrad``, ``differentiable`` and a Tensor ``lr`` are refused;
    ``foreach``, ``capturable`` and ``fused`` are accepted and have no effect
    (the step is always fused and capturable).
    """

    _moment_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 stochastic_rounding=True, moment_dtype=torch.float32, generator=None):
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=False, fused=fused,
                        decoupled_weight_decay=True, stochastic_rounding=stochastic_rounding,
                        moment_dtype=moment_dtype)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = self._scaler_tensors()
        for group in self.param_groups:
            if group.get("amsgrad"):
                raise ValueError("amsgrad=True is not supported by adaptive_amp.optim.AdamW")
            _check_lr(group["lr"])
            params = self._params_with_grad(group, "AdamW")
            for p in params:
                st = self.state[p]
                if len(st) == 0:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, dtype=group["moment_dtype"],
                                                     memory_format=torch.contiguous_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=group["moment_dtype"],
                                                        memory_format=torch.contiguous_format)
            beta1, beta2 = group["betas"]
            for _, ps in _by_device(params):
                steps = [self.state[p]["step"] for p in ps]
                adamw_step_(ps, [p.grad for p in ps], [self.state[p]["exp_avg"] for p in ps],
                            [self.state[p]["exp_avg_sq"] for p in ps], steps, lr=group["lr"], beta1=beta1,
                            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            maximize=group["maximize"], stochastic_rounding=group["stochastic_rounding"],
                            grad_scale=grad_scale, found_inf=found_inf, generator=self.generator)
                # torch's convention: the count moves on unless the step was skipped (on the device).
                torch._foreach_add_(steps, 1)
                if found_inf is not None:
                    torch._foreach_sub_(steps, [found_inf.to(steps[0].device, non_blocking=True).reshape(())]
                                        * len(steps))
                torch.autograd.graph.increment_version(ps)
        return loss


class SGD(_Fused):
    """SGD (momentum, dampening, Nesterov, weight decay, maximize) in one fused native step per param group
    and device; bf16 params written with stochastic rounding. Arguments and defaults as ``torch.optim.SGD``
    plus ``stochastic_rounding``, ``moment_dtype`` and ``generator`` (see :class:`AdamW`).

    A step skipped for ``found_inf`` leaves a new momentum buffer at zero, and
    the next step treats it as not new: ``momentum * 0 + (1 - dampening) * g``,
    which is ``g`` (torch's first-step value) when dampening is 0 (the default).
    """

    _moment_keys = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, stochastic_rounding=True,
                 moment_dtype=torch.float32, generator=None):
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
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=False, fused=fused,
                        stochastic_rounding=stochastic_rounding, moment_dtype=moment_dtype)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = self._scaler_tensors()
        for group in self.param_groups:
            _check_lr(group["lr"])
            params = self._params_with_grad(group, "SGD")
            momentum = group["momentum"]
            first = {}
            if momentum != 0:
                for p in params:
                    st = self.state[p]
                    if st.get("momentum_buffer") is None:
                        st["momentum_buffer"] = torch.zeros_like(p, dtype=group["moment_dtype"],
                                                                 memory_format=torch.contiguous_format)
                        first[p] = True
            for _, ps in _by_device(params):
                bufs = [self.state[p]["momentum_buffer"] for p in ps] if momentum != 0 else []
                sgd_step_(ps, [p.grad for p in ps], bufs, [first.get(p, False) for p in ps] if bufs else [],
                          lr=group["lr"], momentum=momentum, dampening=group["dampening"],
                          weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                          maximize=group["maximize"], stochastic_rounding=group["stochastic_rounding"],
                          grad_scale=grad_scale, found_inf=found_inf, generator=self.generator)
                torch.autograd.graph.increment_version(ps)
        return loss


__all__: List[str] = ["AdamW", "SGD", "adamw_step_", "sgd_step_"]
