"""CUDA graphs of a module's training forward and backward, keyed by the input's shape, and of
functions that need no gradients (`GraphedFunction`).

A detector's backbone is hundreds of small launches (convolutions, frozen batch norms, ReLUs,
the FPN) whose shapes depend only on the padded image batch. With a fixed input size the host
spends longer issuing them than the GPU spends running them. `GraphedTraining` captures the
module's forward and its backward (the gradients of its trainable parameters) as two CUDA
graphs once a shape repeats, and replays them from then on: one launch each way, so the host
runs ahead into the RPN and RoI heads while the GPU works through the backbone.

The graphs run the same kernels on the same values as eager mode, so losses and gradients are
bitwise the same, as long as the gradients arriving at the outputs have the outputs' memory
layout (a gradient in another layout is copied into the captured one, and the backward's
convolutions may then round differently from eager mode's). Each call falls back to eager mode whenever replaying could be wrong:

- not CUDA, not training, gradients disabled, autocast on, an input that requires grad, while
  compiling or capturing another graph;
- any forward or backward hook on the module or a submodule (or a global module hook), or a
  BatchNorm that updates running statistics (its updates would run again in warm-up);
- a previous replay whose backward has not run yet is still alive (two forwards before one
  backward): replaying would overwrite the activations its backward needs.

The graphs are dropped, and captured again when the shape repeats, when the module's
parameters or buffers change storage, dtype or requires_grad (`.to()`, a memory-format
conversion, freezing a stage) or when the cuDNN / TF32 / determinism settings change. Values
written in place (optimizer steps, `load_state_dict`) are read by the next replay.

Gradients come back as new tensors on each backward, so they accumulate and can be kept like
eager ones. The forward's outputs are the graph's static tensors: they stay valid until the
next replay, which is the next training forward.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn


def _flatten(out: Any) -> Tuple[List[Tensor], Any]:
    """(tensors, spec) for a tensor, or a dict / list / tuple of tensors."""
    if isinstance(out, Tensor):
        return [out], None
    if isinstance(out, dict):
        return list(out.values()), (type(out), list(out.keys()))
    if isinstance(out, (list, tuple)) and all(isinstance(t, Tensor) for t in out):
        return list(out), (type(out), len(out))
    raise TypeError(f"GraphedTraining: the module must return a tensor, or a dict, list or tuple of tensors, "
                    f"got {type(out).__name__}")


def _unflatten(tensors: Tuple[Tensor, ...], spec: Any) -> Any:
    if spec is None:
        return tensors[0]
    kind, layout = spec
    return kind(zip(layout, tensors)) if isinstance(layout, list) else kind(tensors)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return any(len(getattr(m, name, ())) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_module_registration_hooks"))


def _signature(module: nn.Module) -> Optional[tuple]:
    """What a captured graph depends on besides the input: every parameter's and buffer's
    storage, dtype and requires_grad, every submodule's training flag, and the backend settings.
    None when the module cannot be graphed (hooks, BatchNorm with running statistics)."""
    state = []
    for m in module.modules():
        if any(getattr(m, name, None) for name in _HOOK_DICTS):
            return None
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
            return None
        state.append(m.training)
        for p in m._parameters.values():
            if p is not None:
                state.append((p.data_ptr(), p.dtype, p.requires_grad, p.stride()))
        for b in m._buffers.values():
            if b is not None:
                state.append((b.data_ptr(), b.dtype))
    cudnn = torch.backends.cudnn
    state.append((cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32,
                  torch.backends.cuda.matmul.allow_tf32, torch.are_deterministic_algorithms_enabled()))
    return tuple(state)


def _autocast_on() -> bool:
    try:
        return torch.is_autocast_enabled("cuda")
    except TypeError:  # older signature
        return torch.is_autocast_enabled()


class _Token:
    """Lives as long as the autograd node of one replay; `done` once its backward ran."""
    __slots__ = ("done", "replay", "__weakref__")

    def __init__(self, replay: int):
        self.done = False
        self.replay = replay


class _Graph:
    """The forward and backward graphs of one module for one input shape.

    Capture runs the module on aliases of its trainable parameters (new leaves sharing their
    storage), so the captured backward has gradient accumulators of its own stream rather than
    ones an earlier eager iteration left on the caller's stream, and in-place updates of the
    real parameters are what the replays read."""

    def __init__(self, module: nn.Module, x: Tensor, warmup: int):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = tuple(p for _, p in named)
        aliases = {n: p.detach().requires_grad_() for n, p in named}
        leaves = tuple(aliases.values())
        self.static_x = torch.empty_like(x)
        self.static_x.copy_(x)

        def run():
            return torch.func.functional_call(module, aliases, (self.static_x,))

        stream = torch.cuda.Stream(device=x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # lazy initialization (cuDNN plans, workspaces) stays out of the graphs
                outs = [o for o in _flatten(run())[0] if o.requires_grad]
                if outs and leaves:
                    torch.autograd.grad(outs, leaves, [torch.zeros_like(o) for o in outs], allow_unused=True)
                del outs
        stream.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = run()
        flat, self.spec = _flatten(out)
        self.static_out = tuple(flat)
        self.needs_grad = tuple(o.requires_grad for o in flat)
        self.static_grad_out = tuple(torch.empty_like(o) for o, r in zip(flat, self.needs_grad) if r)
        self.bwd = torch.cuda.CUDAGraph()
        grads: Tuple[Optional[Tensor], ...] = (None,) * len(leaves)
        with torch.cuda.graph(self.bwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outs = [o for o, r in zip(flat, self.needs_grad) if r]
            if outs and leaves:
                grads = torch.autograd.grad(outs, leaves, self.static_grad_out, allow_unused=True)
        self.static_grads = tuple(grads)
        self.grad_idx = [i for i, g in enumerate(self.static_grads) if g is not None]
        self.replays = 0
        self.pending: Optional[weakref.ref] = None
        torch.cuda.current_stream(x.device).wait_stream(stream)

    def busy(self) -> bool:
        """A replay's outputs are still wired into an autograd graph whose backward has not run."""
        token = self.pending() if self.pending is not None else None
        return token is not None and not token.done


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: _Graph, x: Tensor, *params: Tensor):
        if x.data_ptr() != graph.static_x.data_ptr():
            graph.static_x.copy_(x)
        graph.fwd.replay()
        graph.replays += 1
        token = _Token(graph.replays)
        graph.pending = weakref.ref(token)
        ctx.graph, ctx.token = graph, token
        outs = tuple(o.detach() for o in graph.static_out)
        ctx.mark_non_differentiable(*(o for o, r in zip(outs, graph.needs_grad) if not r))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor):
        graph, token = ctx.graph, ctx.token
        if token.replay != graph.replays:
            raise RuntimeError("GraphedTraining: backward through an older forward after a newer one replayed the "
                               "graph; run the backward of each training forward before the next forward")
        for static, g in zip(graph.static_grad_out, [g for g, r in zip(grads, graph.needs_grad) if r]):
            static.copy_(g)
        graph.bwd.replay()
        token.done = True
        out: List[Optional[Tensor]] = [None] * len(graph.static_grads)
        if graph.grad_idx:
            fresh = torch._foreach_mul([graph.static_grads[i] for i in graph.grad_idx], 1.0)
            for i, g in zip(graph.grad_idx, fresh):
                out[i] = g
        return (None, None, *out)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()


class _Runner:
    """Settings, counters and copies shared by the graph runners: a copy or a pickle keeps the
    settings and drops the graphs."""

    def __init__(self, max_graphs: int, after: int, warmup: int):
        if max_graphs < 0 or after < 1 or warmup < 1:
            raise ValueError(f"{type(self).__name__}: need max_graphs >= 0, after >= 1 and warmup >= 1, got "
                             f"max_graphs={max_graphs}, after={after}, warmup={warmup}")
        self.max_graphs, self.after, self.warmup = max_graphs, after, warmup
        self.reset()

    def reset(self) -> None:
        """Drops every graph (and the memory it holds)."""
        self.graphs: Dict[tuple, Any] = {}
        self.last_key: Optional[tuple] = None
        self.streak = 0
        self.captures = 0
        self.replays = 0

    def __getstate__(self):
        return {"max_graphs": self.max_graphs, "after": self.after, "warmup": self.warmup}

    def __setstate__(self, state):
        self.__init__(**state)

    def __deepcopy__(self, memo):
        return type(self)(self.max_graphs, self.after, self.warmup)

    def _capture_now(self, key: tuple, captured: int) -> bool:
        """Counts a call whose key has no graph yet: True once the key has come `after` times in
        a row and fewer than max_graphs keys have graphs."""
        self.streak = self.streak + 1 if key == self.last_key else 1
        self.last_key = key
        return self.streak >= self.after and captured < self.max_graphs


class GraphedTraining(_Runner):
    """Runs `module(x)` through CUDA graphs of its training forward and backward.

    Args:
        max_graphs (int): input shapes to keep graphs for (each holds its activations in a
            private memory pool); 0 turns graphs off. Further shapes run eagerly.
        after (int): consecutive calls with one shape before it is captured (the first calls
            run eagerly and warm up cuDNN).
        warmup (int): eager iterations on a side stream right before a capture.

    Call as `runner(module, x)`; the runner keeps no reference to the module, so copying or
    pickling a model drops the graphs and keeps the settings. `captures` and `replays` count
    what it did.
    """

    def __init__(self, max_graphs: int = 1, after: int = 3, warmup: int = 2):
        super().__init__(max_graphs, after, warmup)

    def reset(self) -> None:
        """Drops every graph (and the memory they hold)."""
        super().reset()
        self.signature: Optional[tuple] = None

    def _eligible(self, module: nn.Module, x: Tensor) -> bool:
        if self.max_graphs == 0 or not x.is_cuda or not module.training or not torch.is_grad_enabled():
            return False
        if x.requires_grad or _autocast_on() or torch.cuda.is_current_stream_capturing() or _compiling():
            return False
        return not _global_hooks()

    def __call__(self, module: nn.Module, x: Tensor):
        if not self._eligible(module, x):
            return module(x)
        signature = _signature(module)
        if signature is None:
            return module(x)
        if signature != self.signature:
            if self.graphs:
                self.graphs.clear()
                torch.cuda.empty_cache()
            self.signature = signature
        key = (tuple(x.shape), x.stride(), x.dtype, x.device)
        graph = self.graphs.get(key)
        if graph is None:
            if not self._capture_now(key, len(self.graphs)):
                return module(x)
            graph = self.graphs[key] = _Graph(module, x, self.warmup)
            self.captures += 1
        if graph.busy():
            return module(x)
        self.replays += 1
        outs = _Replay.apply(graph, x, *graph.params)
        return _unflatten(outs, graph.spec)


def run_eagerly(fn, *tensors: Tensor, key: tuple = ()) -> Tuple[Tensor, ...]:
    """What a GraphedFunction with max_graphs 0 does: fn(*tensors) with gradients disabled."""
    with torch.no_grad():
        return fn(*tensors)


def _reset_rng_after_failed_capture(device: torch.device, state: Tensor) -> None:
    """A capture that fails leaves the CUDA generator marked as capturing (torch ends that state
    only when a capture ends cleanly), and every later random draw outside a graph would fail.
    A small capture that succeeds ends it; then the generator gets `state` back."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        scratch = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            scratch.add_(torch.rand(1, device=device))
    torch.cuda.current_stream(device).wait_stream(stream)
    del graph
    torch.cuda.set_rng_state(state, device)


class _FunctionGraph:
    """One capture of fn(*inputs) under no_grad, with static inputs and outputs."""

    def __init__(self, fn, inputs: Tuple[Tensor, ...], warmup: int):
        device = inputs[0].device
        self.static_in = tuple(t.clone() for t in inputs)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        rng = torch.cuda.get_rng_state(device)
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(warmup):  # lazy initialization (workspaces, kernel attributes) stays out of the graph
                fn(*self.static_in)
            torch.cuda.set_rng_state(rng, device)  # the warm-up's random numbers are not drawn
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                out = fn(*self.static_in)
        if not isinstance(out, tuple) or not all(isinstance(t, Tensor) for t in out):
            raise TypeError(f"GraphedFunction: the function must return a tuple of tensors, got {type(out).__name__}")
        self.static_out = out
        torch.cuda.current_stream(device).wait_stream(stream)

    def __call__(self, inputs: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        for static, t in zip(self.static_in, inputs):
            if t.data_ptr() != static.data_ptr():
                static.copy_(t)
        self.graph.replay()
        # the caller owns what it gets: the next replay overwrites the static outputs
        return tuple(o.clone() for o in self.static_out)


class GraphedFunction(_Runner):
    """Runs `fn(*tensors)`, a function that needs no gradients, through CUDA graphs.

    For work such as a detector's proposal selection and training-target sampling: hundreds of
    small launches whose shapes follow from the inputs' shapes, where the host spends longer
    issuing the launches than the GPU spends running them. Once a key (the inputs' shapes,
    strides, dtypes and device, the caller's `key`, and the determinism setting) repeats
    `after` times, the call is captured and replayed from then on: the inputs are copied into
    the graph's own (unless they already are them), one launch runs the work, and the outputs
    come back as new tensors.

    `fn` must return a tuple of tensors, wait for nothing on the host, copy nothing between the
    host and the GPU, and take every value that changes between calls from its tensor
    arguments (anything else belongs in `key`). Random numbers drawn through torch's CUDA
    generator advance it as in eager mode, and a replay draws the numbers an eager call would
    have drawn from the same generator state.

    Eager calls (with gradients disabled): CPU inputs, inputs on several devices, while
    capturing or compiling, max_graphs reached, and keys whose capture failed (a warning says
    why; that key is not captured again).

    Args:
        max_graphs (int): keys to keep graphs for; 0 turns graphs off. A runner serves one
            function: its graphs are keyed by inputs, not by function.
        after (int): consecutive calls with one key before it is captured.
        warmup (int): eager calls on a side stream right before a capture.
    """

    def __init__(self, max_graphs: int = 2, after: int = 3, warmup: int = 1):
        super().__init__(max_graphs, after, warmup)

    def _eligible(self, tensors: Tuple[Tensor, ...]) -> bool:
        if self.max_graphs == 0 or not tensors or \
                not all(t.is_cuda and t.device == tensors[0].device for t in tensors) or \
                torch.cuda.is_current_stream_capturing():
            return False
        return not _compiling()

    def __call__(self, fn, *tensors: Tensor, key: tuple = ()) -> Tuple[Tensor, ...]:
        if not self._eligible(tensors):
            return run_eagerly(fn, *tensors)
        full_key = (key, torch.are_deterministic_algorithms_enabled(), _autocast_on(),
                    tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors))
        if full_key not in self.graphs:
            if not self._capture_now(full_key, sum(g is not None for g in self.graphs.values())):
                return run_eagerly(fn, *tensors)
            rng = torch.cuda.get_rng_state(tensors[0].device)
            try:
                self.graphs[full_key] = _FunctionGraph(fn, tensors, self.warmup)
                self.captures += 1
            except RuntimeError as e:  # an uncapturable operation: this key stays eager
                _reset_rng_after_failed_capture(tensors[0].device, rng)
                self.graphs[full_key] = None
                warnings.warn(f"GraphedFunction: capturing {getattr(fn, '__qualname__', fn)} failed, it runs "
                              f"eagerly for these inputs: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        graph = self.graphs[full_key]
        if graph is None:
            return run_eagerly(fn, *tensors)
        self.replays += 1
        return graph(tensors)
