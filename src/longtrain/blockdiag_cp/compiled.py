"""``varlen_attention`` as ``torch.library`` custom ops, for ``torch.compile(..., fullgraph=True)``.

Under ``torch.compiler.is_compiling()`` :func:`~.runtime.varlen_attention` calls :func:`varlen_attention_op`
instead of its eager body, so dynamo records one opaque op (``torch.ops.longtrain.varlen_attention``) whose fake
implementation gives the output's metadata, ``[T_q, Hq, Dv]`` in q's dtype, contiguous. At run time the op's real
implementation is the eager :func:`~.runtime.varlen_attention` itself: offsets validated on the host (a bad
``cu_seqlens`` is the same ``ValueError``), the offsets caches, the provider choice, all unchanged.

The backward (``torch.ops.longtrain.varlen_attention_backward``) recomputes: it runs the eager attention again under
autograd on detached q/k/v and returns their gradients, so each compiled call costs one more attention forward in
the backward (and saves q, k, v and the offsets, no output). Eager calls never come here and keep the providers'
own backward.

A caller that must check something on the host before the attention (torchtitan's ``BlockdiagAttention`` checks that
its masks cover every row) registers the check by name with :func:`register_host_check` and passes the name and
its integer arguments: the check runs at run time inside the op, where host syncs are allowed.

Attention dropout is not routed here: the recompute would draw another mask. ``varlen_attention`` with
``dropout_p > 0`` keeps running eagerly (a graph break, so not under ``fullgraph=True``).

The runtime's implementations live in one table, :data:`IMPL`, filled by the runtime with :func:`register_eager`:
the public functions call through it, :func:`maybe_disable_dynamo` swaps its entries for
``torch.compiler.disable``-d versions, and the op's real implementation calls its ``"varlen"`` entry. So this module
imports nothing of the package, and the step builders hide the runtime from dynamo without importing the runtime.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "HOST_CHECKS",
    "IMPL",
    "NOT_TRACEABLE",
    "maybe_disable_dynamo",
    "register_eager",
    "register_host_check",
    "varlen_attention_op",
]

#: name -> the runtime's implementation behind a public function (``"varlen"``, ``"cp_varlen"``,
#: ``"cp_blockdiag_sdpa"``); :func:`maybe_disable_dynamo` replaces each with its ``torch.compiler.disable``-d version.
IMPL: dict[str, Callable] = {}
_EAGER: dict[str, Callable] = {}

NOT_TRACEABLE = (
    "block-diagonal CP runtime (collectives, host syncs): it runs eagerly at a graph break, so torch.compile("
    "fullgraph=True) cannot compile it; fullgraph=True supports varlen_attention (without dropout) and torchtitan's "
    "BlockdiagAttention outside a CP step. Compile blocks that run CP attention with fullgraph=False"
)


def register_eager(name: str, fn: Callable) -> None:
    """Put the runtime's implementation ``fn`` in :data:`IMPL` under ``name`` (the runtime does, at import)."""
    _EAGER[name] = fn
    IMPL[name] = fn


def maybe_disable_dynamo() -> None:
    """Hide the runtime from torch.compile tracing (host syncs, collectives and Python control flow).

    Called eagerly by the step builders; a no-op until the user's program has imported ``torch._dynamo``
    (``torch.compile`` does), so ``import longtrain`` never imports it (importing it would import triton).
    """
    if "torch._dynamo" not in sys.modules:
        return
    for name, fn in _EAGER.items():
        if IMPL[name] is not fn:
            continue
        try:
            IMPL[name] = torch._dynamo.disable(fn, reason=NOT_TRACEABLE)
        except TypeError:  # torch without the ``reason`` keyword
            IMPL[name] = torch._dynamo.disable(fn)


#: name -> ``check(cu_seqlens_q, cu_seqlens_k, args)``, run on the host inside the op before the attention.
HOST_CHECKS: dict[str, Callable[[torch.Tensor, torch.Tensor, list[int]], None]] = {}


def register_host_check(name: str, check: Callable[[torch.Tensor, torch.Tensor, list[int]], None]) -> None:
    """Register ``check(cu_seqlens_q, cu_seqlens_k, args)`` under ``name`` for :func:`varlen_attention_op`'s
    ``host_check``; it raises to refuse the call. Registering a name again replaces its check."""
    if not name:
        raise ValueError("a host check needs a non-empty name ('' means no check)")
    HOST_CHECKS[name] = check


def _eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, backend):
    """The eager ``varlen_attention`` body without dropout (run time, never traced here)."""
    return IMPL["varlen"](q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                          0.0, backend)  # fmt: skip


@torch.library.custom_op("longtrain::varlen_attention", mutates_args=())
def _varlen_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float | None,
    backend: str,
    host_check: str,
    host_check_args: list[int],
) -> torch.Tensor:
    if host_check:
        HOST_CHECKS[host_check](cu_seqlens_q, cu_seqlens_k, list(host_check_args))
    out = _eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, backend)
    return out.contiguous()  # the fake's layout, which inductor's code after the op assumes


@_varlen_attention_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, backend, host_check,
      host_check_args):  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


class _AutogradOn:
    """Autograd back on inside an op's implementation (the dispatcher runs it with the autograd keys excluded):
    the recompute records a graph to differentiate. Leaves every other excluded key (autocast among them) as the
    forward op ran."""

    def __enter__(self) -> None:
        keys = torch._C._dispatch_tls_local_exclude_set()
        for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView,
                    torch._C.DispatchKey.AutogradOther):  # fmt: skip
            keys = keys.remove(key)
        self._guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys)
        self._guard.__enter__()
        self._grad = torch.enable_grad()
        self._grad.__enter__()

    def __exit__(self, *exc) -> None:
        self._grad.__exit__(*exc)
        self._guard.__exit__(*exc)


@torch.library.custom_op("longtrain::varlen_attention_backward", mutates_args=())
def _varlen_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _AutogradOn():
        inputs = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
        out = _eager(*inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, backend)
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, (q, k, v)))


@_varlen_attention_bwd.register_fake
def _(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, backend):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, backend, _, _ = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, backend)


def _backward(ctx, grad_out):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.longtrain.varlen_attention_backward(grad_out, q, k, v, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_varlen_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    host_check: str = "",
    host_check_args: Sequence[int] = (),
) -> torch.Tensor:
    """:func:`~.runtime.varlen_attention` without dropout as one opaque op (same arguments, shapes and result; see
    the module docstring for the recomputing backward, which could not redraw a dropout mask). ``host_check``: a
    name given to :func:`register_host_check` (``""``: none), called with ``host_check_args`` before the
    attention."""
    if host_check and host_check not in HOST_CHECKS:
        raise ValueError(f"unknown host_check {host_check!r}; registered: {sorted(HOST_CHECKS)}")
    return torch.ops.longtrain.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
        None if softmax_scale is None else float(softmax_scale), backend, host_check,
        list(host_check_args),
    )  # fmt: skip
