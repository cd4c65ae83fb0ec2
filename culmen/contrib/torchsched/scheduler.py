"""Multi-stream scheduling of an ATen FX graph: which stream runs each op, where streams wait for each other.

The input is a post-autograd graph (AOTAutograd's forward or backward: ``call_function`` nodes on
``torch.ops.aten`` overloads with ``meta["val"]`` fake tensors). The plan:

1. **Cost** of each op: ``max(flops / 64, bytes read + written)`` plus a launch cost (flops from
   ``torch.utils.flop_counter``'s formulas); views, ``getitem`` and other kernel-free nodes cost nothing.
2. **Critical path**: the longest chain of costs ending at an output. It stays on stream 0, the caller's
   stream, so the longest dependency chain never pays for a stream hop.
3. **Branches**: every other op continues the stream of a producer it extends (one continuation per
   producer, so a chain stays on one stream) or, starting a new branch, takes the next side stream
   round-robin (streams ``1 .. num_streams - 1``). Kernel-free nodes run on their first consumer's stream.
   Mutating ops, collectives and anything not an ATen overload stay on stream 0, and a mutating op is a
   full barrier (it waits for every stream, and every stream waits for it).
4. **Synchronization**: ops are issued in the graph's order (the host order, and so the RNG order, is
   unchanged); an op waits on an event recorded after each producer on another stream, unless a vector
   clock shows the stream already waited on that producer (directly or through another stream).
   Events are recorded only where waited on and, with ``reuse_cuda_event``, recycled after their last
   waiter has been issued.
5. **Memory**: a tensor used on a stream other than the one that allocated its memory gets
   ``record_stream`` for that stream (outputs made on side streams: for stream 0), so the caching
   allocator never hands its block out while another stream may still read it. Every side stream
   waits for stream 0 when the graph starts and stream 0 waits for every side stream before the graph
   returns.

``build_scheduled_module`` turns the plan into a new ``GraphModule`` whose generated Python code calls a
runtime object (``CudaStreamRuntime``) between the ops; its host cost is one call per stream switch,
event or ``record_stream``.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

__all__ = ["CudaStreamRuntime", "StreamPlan", "build_scheduled_module", "plan_streams"]

log = logging.getLogger("culmen.contrib.torchsched")

_LAUNCH_COST = 16384.0  # a kernel launch, in the byte units of the cost model
_PINNED_NAMESPACES = {"_c10d_functional", "c10d_functional", "c10d", "_dtensor", "symm_mem"}
_CHEAP_OPS = {"_unsafe_view", "alias", "detach", "lift_fresh", "sym_size", "sym_stride", "sym_numel",
              "sym_storage_offset"}


@dataclass
class StreamPlan:
    """What ``plan_streams`` decided for one graph.

    Attributes:
        stream_of: stream index of every ``call_function`` node (0 = the caller's stream).
        program: instructions in issue order: ``("node", n)``, ``("switch", s)``, ``("wait", s, slot)``
            (stream ``s`` waits on event ``slot``), ``("record", slot)`` (on the current stream),
            ``("record_stream", n, s)``, ``("join", streams)`` (stream 0 waits for those side streams).
        side_streams: the side streams the program uses, sorted.
        num_events: event slots the program needs.
        critical_path: the nodes of the critical path, first to last.
    """

    stream_of: dict[fx.Node, int]
    program: list[tuple]
    side_streams: list[int]
    num_events: int
    critical_path: list[fx.Node] = field(default_factory=list)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _nbytes(v: Any) -> int:
    total = 0
    for t in _tensors(v):
        try:
            total += int(t.numel()) * t.element_size()
        except Exception:  # symbolic sizes: no estimate
            pass
    return total


def _is_free(n: fx.Node) -> bool:
    """Nodes that launch no kernel: getitem, views, metadata queries."""
    if n.target is operator.getitem:
        return True
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return bool(getattr(t, "is_view", False)) or t.__name__.split(".")[0] in _CHEAP_OPS
    return False


def _is_pinned(n: fx.Node) -> bool:
    """Nodes that must run on stream 0: not ATen overloads, collectives, mutations."""
    if n.op != "call_function":
        return True
    if n.target is operator.getitem:
        return False
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return True
    return t.namespace in _PINNED_NAMESPACES or t._schema.is_mutable


def _is_barrier(n: fx.Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def _flops(n: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    f = flop_registry.get(getattr(n.target, "overloadpacket", None))
    if f is None:
        return 0.0
    try:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), _val)
        return float(f(*args, **kwargs, out_val=_val(n)))
    except Exception:  # a formula that does not take these arguments: bytes only
        return 0.0


def _cost(n: fx.Node) -> float:
    if _is_free(n):
        return 0.0
    moved = _nbytes(_val(n)) + sum(_nbytes(_val(a)) for a in n.all_input_nodes)
    return max(_flops(n) / 64.0, float(moved)) + _LAUNCH_COST


def plan_streams(graph: fx.Graph, num_streams: int, reuse_events: bool = True) -> StreamPlan:
    """Assign the ``call_function`` nodes of ``graph`` to ``num_streams`` streams and synchronize them.

    Args:
        graph: a post-autograd ATen graph (see the module docstring); not modified.
        num_streams: streams to use, the caller's included (>= 1; 1 puts everything on stream 0).
        reuse_events: recycle event slots once their last waiter has been issued.
    """
    if isinstance(num_streams, bool) or not isinstance(num_streams, int) or num_streams < 1:
        raise ValueError(f"num_streams must be an int >= 1, got {num_streams!r}")
    nodes = list(graph.nodes)
    ops = [n for n in nodes if n.op == "call_function"]
    output = next(n for n in reversed(nodes) if n.op == "output")

    # Longest path (by cost) to every node, and the critical path ending at the costliest output.
    dist: dict[fx.Node, float] = {}
    best_pred: dict[fx.Node, fx.Node | None] = {}
    for n in nodes:
        preds = [p for p in n.all_input_nodes if p in dist]
        p = max(preds, key=dist.__getitem__) if preds else None
        best_pred[n] = p
        dist[n] = (dist[p] if p is not None else 0.0) + (_cost(n) if n.op == "call_function" else 0.0)
    critical: list[fx.Node] = []
    tail = best_pred[output]
    while tail is not None:
        if tail.op == "call_function":
            critical.append(tail)
        tail = best_pred[tail]
    critical.reverse()
    on_critical = set(critical)

    # Streams of the kernel nodes, in issue order.
    stream_of: dict[fx.Node, int] = {}
    continued: set[fx.Node] = set()
    rr = 0

    def real_preds(n: fx.Node) -> list[fx.Node]:
        out = []
        for p in n.all_input_nodes:
            if p.op == "call_function" and _is_free(p):
                out.extend(real_preds(p))
            elif p.op == "call_function":
                out.append(p)
        return out

    for n in ops:
        if _is_free(n):
            continue
        if num_streams == 1 or _is_pinned(n) or n in on_critical:
            stream_of[n] = 0
            continue
        for p in real_preds(n):
            if stream_of.get(p, 0) != 0 and p not in continued:
                continued.add(p)
                stream_of[n] = stream_of[p]
                break
        else:
            stream_of[n] = 1 + rr % (num_streams - 1)
            rr += 1
    # Kernel-free nodes run where their first consumer runs (the output counts as stream 0); later nodes
    # first, so a chain of views follows its last consumer.
    pos = {n: i for i, n in enumerate(nodes)}
    for n in reversed(ops):
        if _is_free(n):
            first = min(n.users, key=pos.__getitem__) if n.users else None
            stream_of[n] = stream_of[first] if first is not None and first.op == "call_function" else 0

    # Pass A: waits, with vector clocks (clock[s][t] = how many ops of stream t stream s has waited for).
    clock: dict[int, dict[int, int]] = defaultdict(dict)
    count: dict[int, int] = defaultdict(int)
    where: dict[fx.Node, tuple[int, int]] = {}
    snapshot: dict[fx.Node, dict[int, int]] = {}
    last_on: dict[int, fx.Node] = {}
    waits: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    last_barrier: fx.Node | None = None

    def need(s: int, p: fx.Node, waiter: fx.Node) -> None:
        t, i = where[p]
        if t == s or clock[s].get(t, 0) >= i:
            return
        waits[waiter].append(p)
        for k, v in snapshot[p].items():
            if v > clock[s].get(k, 0):
                clock[s][k] = v

    for n in ops:
        s = stream_of[n]
        deps = [p for p in n.all_input_nodes if p in stream_of]
        if _is_barrier(n):
            deps += [last_on[t] for t in sorted(last_on) if t != 0]
        elif s != 0 and last_barrier is not None:
            deps.append(last_barrier)
        for p in deps:
            need(s, p, n)
        count[s] += 1
        where[n] = (s, count[s])
        clock[s][s] = count[s]
        snapshot[n] = dict(clock[s])
        last_on[s] = n
        if _is_barrier(n):
            last_barrier = n
    join = [t for t in sorted(count) if t != 0 and clock[0].get(t, 0) < count[t]]

    # record_stream targets: a tensor used on a stream other than the one its memory was allocated on
    # (the output node uses on stream 0). Views share their base's memory: the allocating stream is their
    # base's; views of graph inputs need nothing (the caller holds the inputs past the final join).
    alloc: dict[fx.Node, int | None] = {}
    for n in ops:
        if not _is_free(n):
            alloc[n] = stream_of[n]
        elif n.target is operator.getitem:
            alloc[n] = stream_of.get(n.args[0], 0)
        else:
            base = next((p for p in n.all_input_nodes if _tensors(_val(p))), None)
            alloc[n] = alloc.get(base) if base is not None else None
    rec_streams: dict[fx.Node, list[int]] = {}
    for n in ops:
        if alloc[n] is None or not _tensors(_val(n)):
            continue
        users = {0 if u.op == "output" else stream_of.get(u, 0) for u in n.users}
        other = sorted(users - {alloc[n]})
        if other:
            rec_streams[n] = other

    # Pass B: the program, with event slots.
    waited_by: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for w, ps in waits.items():
        for p in ps:
            waited_by[p].append(w)
    last_waiter = {p: ws[-1] for p, ws in waited_by.items()}
    free_slots: list[int] = []
    slot_of: dict[fx.Node, int] = {}
    num_events = 0
    program: list[tuple] = []
    current = 0
    for n in nodes:
        if n.op == "output" and join:
            program.append(("join", tuple(join)))
            current = 0
        if n.op != "call_function":
            program.append(("node", n))
            continue
        s = stream_of[n]
        if s != current:
            program.append(("switch", s))
            current = s
        released = []
        for p in waits.get(n, ()):
            program.append(("wait", s, slot_of[p]))
            if last_waiter[p] is n:
                released.append(slot_of[p])
        program.append(("node", n))
        if reuse_events:
            free_slots.extend(released)
        if n in waited_by:
            if free_slots:
                slot = free_slots.pop()
            else:
                slot, num_events = num_events, num_events + 1
            slot_of[n] = slot
            program.append(("record", slot))
        for t in rec_streams.get(n, ()):
            program.append(("record_stream", n, t))
    if current != 0:  # graphs without side work to join still end on the caller's stream
        program.insert(len(program) - 1, ("switch", 0))
    return StreamPlan(stream_of=stream_of, program=program, side_streams=sorted(t for t in count if t != 0),
                      num_events=num_events, critical_path=critical)


class CudaStreamRuntime:
    """The CUDA side of a scheduled graph: its side streams, events and the calls the generated code makes.

    Side streams come from a per-device pool shared by every scheduled graph; stream 0 is whatever stream
    is current when the graph is called (``begin``), so callers' streams and CUDA graphs keep working.
    """

    _POOL: dict[tuple[int, int], torch.cuda.Stream] = {}

    def __init__(self, device: torch.device, side_streams: list[int], num_events: int) -> None:
        self.device = device
        n = max(side_streams, default=0) + 1
        self.streams: list[Any] = [None] * n
        for s in side_streams:
            key = (device.index or 0, s)
            if key not in self._POOL:
                self._POOL[key] = torch.cuda.Stream(device=device)
            self.streams[s] = self._POOL[key]
        self.side = [self.streams[s] for s in side_streams]
        self.events = [torch.cuda.Event() for _ in range(num_events)]
        self._fork = torch.cuda.Event()
        self._joins = {s: torch.cuda.Event() for s in side_streams}

    def begin(self) -> None:
        """Stream 0 := the current stream; every side stream waits for the work already queued on it."""
        main = torch.cuda.current_stream(self.device)
        self.streams[0] = main
        self._fork.record(main)
        for st in self.side:
            st.wait_event(self._fork)

    def end(self) -> None:
        torch.cuda.set_stream(self.streams[0])

    def switch(self, s: int) -> None:
        torch.cuda.set_stream(self.streams[s])

    def wait(self, s: int, slot: int) -> None:
        self.streams[s].wait_event(self.events[slot])

    def record(self, slot: int, s: int) -> None:
        self.events[slot].record(self.streams[s])

    def record_stream(self, value: Any, s: int) -> None:
        for t in _tensors(value):
            if t.is_cuda:
                t.record_stream(self.streams[s])

    def join(self, streams: tuple[int, ...]) -> None:
        main = self.streams[0]
        for s in streams:
            ev = self._joins[s]
            ev.record(self.streams[s])
            main.wait_event(ev)
        torch.cuda.set_stream(main)


def build_scheduled_module(gm: fx.GraphModule, plan: StreamPlan, runtime: Any) -> fx.GraphModule:
    """A copy of ``gm`` whose code issues ``plan.program``: ``runtime`` (a ``CudaStreamRuntime`` or any object
    with its ``switch(s)`` / ``wait(s, slot)`` / ``record(slot, s)`` / ``record_stream(t, s)`` / ``join(streams)``
    methods) is called in between
    the ops. The caller brackets each call with ``runtime.begin()`` / ``runtime.end()``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    current = 0  # events are recorded on an explicit stream: the graph's device need not be the current one
    for ins in plan.program:
        kind = ins[0]
        if kind == "node":
            n = ins[1]
            env[n] = graph.node_copy(n, env.__getitem__)
        elif kind == "switch":
            current = ins[1]
            graph.call_function(runtime.switch, (current,))
        elif kind == "wait":
            graph.call_function(runtime.wait, (ins[1], ins[2]))
        elif kind == "record":
            graph.call_function(runtime.record, (ins[1], current))
        elif kind == "record_stream":
            graph.call_function(runtime.record_stream, (env[ins[1]], ins[2]))
        elif kind == "join":
            current = 0
            graph.call_function(runtime.join, (ins[1],))
    return fx.GraphModule(gm, graph)


def describe(plan: StreamPlan) -> str:
    """One line per stream: how many ops it runs (for the debug log)."""
    per: dict[int, int] = defaultdict(int)
    for n, s in plan.stream_of.items():
        if not _is_free(n):
            per[s] += 1
    streams = ", ".join(f"stream {s}: {per[s]} ops" for s in sorted(per))
    return f"{streams}; {plan.num_events} events; critical path {len(plan.critical_path)} ops"
