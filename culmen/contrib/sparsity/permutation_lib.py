"""Offline input-channel permutation of a model before 2:4 pruning (``apex.contrib.sparsity.permutation_lib``).

Reordering the input channels ``C`` of a layer changes which weights fall in the same group of 4, so a
good order keeps more magnitude under the 2:4 mask. To leave the network's function unchanged, the
layers producing those channels (their *parents*) have their output channels ``K`` (weight rows, bias)
reordered the same way, and so does every channel-wise layer in between (BatchNorm / LayerNorm / ...
parameters and running statistics).

How culmen finds what may be permuted (its own analysis, stricter than Apex's): the model is traced
with ``torch.fx``; ``Linear`` and ungrouped ``Conv1d/2d/3d`` are *real* nodes. From each real node's
input, the graph is walked back through *pass-through* nodes (element-wise activations, dropout,
pooling, identity, softmax, channel-wise norms, scalar arithmetic) to the real parents. Children that
share a parent form one *sibling group*, which gets one permutation; it is applied only when every
path from each parent's output leads, through pass-through nodes only, to children of the group, the
channel counts agree, no module is called twice and no parameter is shared. Anything else (graph
inputs or outputs, residual adds, reshapes, concatenations, unknown ops) blocks the group, so a
permutation never changes what the model computes.

Differences from Apex: searches use a private random generator (seeded by ``set_identical_seed``)
instead of reseeding the global RNGs; in distributed runs rank 0 searches and broadcasts the
permutations (``set_tcpstore_port`` is kept for compatibility, the sync uses the process group);
grouped convolutions, ``MultiheadAttention`` and channel concatenations are not permuted.
"""

from __future__ import annotations

import json
import operator
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from culmen.contrib.sparsity.permutation_search_kernels import accelerated_search_for_good_permutation, sum_after_2_to_4

__all__ = ["Permutation", "node_name_matches", "replicate_sequence"]

_REAL_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
               nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm)
_SIMPLE_MODULE_TYPES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid,
                        nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Mish, nn.Softplus, nn.Hardtanh, nn.PReLU,
                        nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                        nn.FeatureAlphaDropout, nn.Identity, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
                        nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                        nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
                        nn.Softmax, nn.LogSoftmax, nn.Softmin)
_SIMPLE_FUNCTIONS = {torch.relu, torch.sigmoid, torch.tanh, torch.nn.functional.relu, F.relu6, F.gelu, F.silu,
                     F.leaky_relu, F.elu, F.mish, F.hardswish, F.hardsigmoid, F.softplus, F.dropout, F.sigmoid,
                     F.tanh, torch.nn.functional.hardtanh, F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d,
                     F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, torch.abs, torch.neg, torch.square}
_SCALAR_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.mul,
                     torch.sub, torch.div}
_SIMPLE_METHODS = {"relu", "sigmoid", "tanh", "contiguous", "clone", "abs", "neg", "square", "detach"}


def node_name_matches(node_name: str, module_name: str) -> bool:
    """Whether an fx node name refers to a module name (ignoring punctuation, case and a DDP
    ``module.`` prefix)."""
    def canon(name: str) -> str:
        return "".join(ch for ch in name if ch.isalnum()).lower()
    a, b = canon(node_name), canon(module_name)
    return node_name == module_name or "module." + node_name == module_name or a == b or "module" + a == b


def replicate_sequence(sequence: Iterable[int], replications: int) -> list[int]:
    """Repeat a permutation of ``len(sequence)`` channels over ``replications`` consecutive blocks."""
    seq = list(sequence)
    return [c + rep * len(seq) for rep in range(replications) for c in seq]


def _weight_rows_channels(w: torch.Tensor) -> torch.Tensor:
    """A weight as ``(rows, C)`` with the input channels last (the layout masks are computed in)."""
    if w.dim() == 2:
        return w
    return w.permute(*range(2, w.dim()), 0, 1).reshape(-1, w.shape[1])


class Permutation:
    """Class-level state and steps of the permutation pass (Apex's classmethod API)."""

    __model: nn.Module | None = None
    __sparse_parameters: list = []
    __all_parameters: list = []
    __allow_permutation = False
    __verbosity = 0
    __params_permuted_in_C: list[str] = []
    __params_permuted_in_K: list[str] = []
    __unpermuted_dims: list[str] = []
    __save_permutation_graph = False
    __permutation_output_dir = "."
    __manual_seed: int | None = None
    __tcpstore_port = 2341
    __search_options: dict[str, Any] | None = None
    __applied: list[tuple[torch.Tensor, int, list[int]]] = []

    # -- settings ----------------------------------------------------------------------------------
    @classmethod
    def set_identical_seed(cls, identical_seed: int = 1) -> None:
        """Seed the searches' private generator so every rank finds the same permutations."""
        cls.__manual_seed = int(identical_seed)

    @classmethod
    def reset_seed(cls) -> None:
        """Re-arm the seed before a search (a no-op beyond checking one was set: each search seeds its
        own generator from it)."""
        if cls.__manual_seed is None:
            raise RuntimeError("call Permutation.set_identical_seed() before reset_seed()")

    @classmethod
    def set_tcpstore_port(cls, tcpstore_port: int) -> None:
        """Kept for Apex compatibility; culmen syncs permutations through the default process group."""
        cls.__tcpstore_port = int(tcpstore_port)

    @classmethod
    def set_permutation_saving_params(cls, allow_permutation: bool = False, save_permutation_graph: bool = False,
                                      permutation_output_dir: str = ".") -> None:
        """Whether permutations are allowed, and whether / where the analysed graph is saved as JSON."""
        cls.__allow_permutation = bool(allow_permutation)
        cls.__save_permutation_graph = bool(save_permutation_graph)
        cls.__permutation_output_dir = permutation_output_dir

    @classmethod
    def set_permutation_params_from_asp(cls, model: nn.Module, sparse_parameters: list, all_parameters: list,
                                        verbosity: int = 0) -> None:
        """Hand over ASP's model and its parameter lists (the lists are shared, not copied)."""
        cls.__model = model
        cls.__sparse_parameters = sparse_parameters
        cls.__all_parameters = all_parameters
        cls.__verbosity = verbosity
        cls.__params_permuted_in_C, cls.__params_permuted_in_K, cls.__unpermuted_dims = [], [], []

    @classmethod
    def set_permutation_search_options(cls, options: dict[str, Any] | None) -> None:
        """culmen addition: the ``options`` handed to ``accelerated_search_for_good_permutation`` for
        every sibling group (``None``: Apex's choice, exhaustive with windows of 8 and 100 escapes up
        to 2048 channels, progressive channel swap for 120 s above)."""
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
        cls.__search_options = None if options is None else dict(options)

    @classmethod
    def get_permutation_stats(cls) -> tuple[list[str], list[str], list[str]]:
        """``(params permuted in C, params permuted in K, dims that could not be permuted)``."""
        return list(cls.__params_permuted_in_C), list(cls.__params_permuted_in_K), list(cls.__unpermuted_dims)

    @classmethod
    def applied_permutations(cls) -> list[tuple[torch.Tensor, int, list[int]]]:
        """``(parameter or buffer, dim, order)`` for every tensor the last ``permute_model`` reordered
        (ASP uses it to reorder optimizer state the same way)."""
        return list(cls.__applied)

    # -- graph -----------------------------------------------------------------------------------
    @classmethod
    def trace_and_print_raw_fx_graph(cls, model: nn.Module, print_tabular: bool = False,
                                     generate_python_code: bool = False) -> torch.fx.GraphModule | None:
        """``torch.fx.symbolic_trace(model)``, or ``None`` (with a message at verbosity > 0) if it fails."""
        try:
            traced = torch.fx.symbolic_trace(model)
        except Exception as exc:  # any tracing failure just means "no permutation"
            if cls.__verbosity > 0:
                print(f"[permutation_lib] torch.fx cannot trace the model ({type(exc).__name__}: {exc}); "
                      "skipping permutations")
            return None
        if print_tabular:
            print(traced.graph)
        if generate_python_code:
            print(traced.code)
        return traced

    @classmethod
    def build_fx_graph(cls, model: nn.Module, dump_fx_graph: bool = False,
                       save_dumped_fx_graph: str = "./model_fx_graph.json") -> tuple[dict[str, dict], bool]:
        """Analyse ``model``: returns ``(graph, success)`` where ``graph`` maps each real node's module
        name to ``{"module_type", "C", "K", "real_parents", "permutable_C", "passthru"}`` plus an entry
        ``"sibling_groups"`` listing the groups that may be permuted (``children``, ``parents``,
        ``passthru`` module names, ``C``)."""
        traced = cls.trace_and_print_raw_fx_graph(model, print_tabular=cls.__verbosity > 2)
        if traced is None:
            return {}, False
        graph = _analyse(traced, model)
        if dump_fx_graph:
            cls.save_graph_to_json(graph, save_dumped_fx_graph)
        return graph, True

    @classmethod
    def save_graph_to_json(cls, graph: dict, save_dumped_graph_path_with_name: str = "./model_fx_graph.json") -> None:
        """Write an analysed graph as JSON (for inspection)."""
        directory = os.path.dirname(save_dumped_graph_path_with_name)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(save_dumped_graph_path_with_name, "w", encoding="utf-8") as fh:
            json.dump(graph, fh, indent=1, default=str)

    # -- search and application --------------------------------------------------------------------
    @classmethod
    def find_permutation_for_matrix_group(cls, matrix_group: torch.Tensor) -> tuple[list[int], bool]:
        """Search one permutation for a ``(rows, C)`` group of concatenated weights. Returns
        ``(order, found)``; ``found`` is False when 2:4 already keeps almost all magnitude."""
        c = matrix_group.shape[1]
        identity = list(range(c))
        total = float(matrix_group.detach().abs().double().sum())
        kept = sum_after_2_to_4(matrix_group)
        if total == 0 or abs(total - kept) / total < 1e-3:
            return identity, False
        if cls.__search_options is not None:
            options = dict(cls.__search_options)
        elif c > 2048:
            options = {"strategy": "progressive channel swap", "progressive_search_time_limit": 120,
                       "improvement_threshold": 1e-9}
        else:
            options = {"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 100}
        options.setdefault("seed", cls.__manual_seed if cls.__manual_seed is not None else 1)
        order = accelerated_search_for_good_permutation(matrix_group, options=options, verbosity=cls.__verbosity)
        return order, order != identity

    @classmethod
    def apply_permutation_in_C_dim(cls, node_name: str, permutation_sequence: list[int], dryrun: bool = False) -> bool:
        """Reorder dim 1 (input channels) of the ``weight`` of module ``node_name``."""
        module = cls._module(node_name)
        if module is None or getattr(module, "weight", None) is None or len(permutation_sequence) == 0:
            return False
        w = module.weight
        if w.shape[1] != len(permutation_sequence):
            return False
        if not dryrun:
            cls._permute(w, 1, permutation_sequence)
            cls.__params_permuted_in_C.append(node_name + ".weight")
        return True

    @classmethod
    def apply_permutation_in_K_dim(cls, node_name: str, permutation_sequence: list[int], fx_graph: dict | None = None,
                                   dryrun: bool = False) -> bool:
        """Reorder dim 0 (output channels) of every parameter / running statistic of module
        ``node_name`` whose dim 0 has the permutation's length."""
        module = cls._module(node_name)
        if module is None or len(permutation_sequence) == 0:
            return False
        tensors = [(n, t) for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                   if t is not None and t.dim() >= 1 and t.shape[0] == len(permutation_sequence)]
        if not tensors:
            return False
        if not dryrun:
            for name, t in tensors:
                cls._permute(t, 0, permutation_sequence)
                cls.__params_permuted_in_K.append(f"{node_name}.{name}")
        return True

    @classmethod
    def permute_model(cls, model: nn.Module, dump_fx_graph: bool = False,
                      save_dumped_fx_graph: str = "./model_permutation_graph.json") -> bool:
        """Analyse ``model``, search a permutation per sibling group and apply it in place. Returns
        whether the model could be analysed (False: not traceable, nothing changed)."""
        cls.__model = model
        cls.__applied = []
        graph, ok = cls.build_fx_graph(model, dump_fx_graph, save_dumped_fx_graph)
        if not ok:
            return False
        groups = graph["sibling_groups"]
        sparse_names = {name for name, *_ in cls.__sparse_parameters}
        start = time.perf_counter()
        found: list[list[int] | None] = []
        for group in groups:
            found.append(cls._search_group(model, group, sparse_names))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Every rank must permute identically: rank 0's result wins.
            payload = [found]
            torch.distributed.broadcast_object_list(payload, src=0)
            found = payload[0]
        for group, order in zip(groups, found):
            if order is None:
                continue
            for child in group["children"]:
                cls.apply_permutation_in_C_dim(child, order)
            for name in [*group["parents"], *group["passthru"]]:
                cls.apply_permutation_in_K_dim(name, order)
        cls.__unpermuted_dims = list(graph.get("blocked", []))
        if cls.__verbosity > 1:
            applied = sum(o is not None for o in found)
            print(f"[permute_model] {applied} of {len(groups)} sibling groups permuted in "
                  f"{time.perf_counter() - start:.3f} s")
        if cls.__save_permutation_graph:
            cls.save_graph_to_json(graph, os.path.join(cls.__permutation_output_dir, "model_permutation_graph.json"))
        return True

    # -- helpers -----------------------------------------------------------------------------------
    @classmethod
    def _module(cls, name: str) -> nn.Module | None:
        if cls.__model is None:
            return None
        try:
            return cls.__model.get_submodule(name)
        except AttributeError:
            for module_name, module in cls.__model.named_modules():
                if node_name_matches(name, module_name):
                    return module
        return None

    @classmethod
    def _permute(cls, t: torch.Tensor, dim: int, order: list[int]) -> None:
        idx = torch.as_tensor(order, device=t.device)
        with torch.no_grad():
            t.copy_(t.index_select(dim, idx))
        cls.__applied.append((t, dim, list(order)))

    @classmethod
    def _search_group(cls, model: nn.Module, group: dict, sparse_names: set[str]) -> list[int] | None:
        c = int(group["C"])
        if c % 4 or c < 8:
            return None
        mats = [_weight_rows_channels(model.get_submodule(ch).weight.detach())
                for ch in group["children"] if ch in sparse_names]
        if not mats:
            return None
        order, found = cls.find_permutation_for_matrix_group(torch.cat([m.float() for m in mats], 0))
        return order if found else None


def _analyse(traced: torch.fx.GraphModule, model: nn.Module) -> dict[str, Any]:
    """The graph analysis behind ``Permutation.build_fx_graph`` (see the module docstring)."""
    modules = dict(traced.named_modules())
    calls: dict[str, int] = {}
    for node in traced.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    param_owner: dict[int, set[str]] = {}
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            param_owner.setdefault(id(p), set()).add(name)
    shared = {n for owners in param_owner.values() if len(owners) > 1 for n in owners}

    def kind(node: torch.fx.Node) -> str:
        """'real', 'norm', 'simple' or 'block' for one graph node."""
        if node.op == "call_module":
            mod = modules[node.target]
            if calls[node.target] > 1 or node.target in shared:
                return "block"
            if isinstance(mod, _REAL_TYPES):
                return "real" if getattr(mod, "groups", 1) == 1 else "block"
            if isinstance(mod, _NORM_TYPES):
                return "norm"
            if isinstance(mod, _SIMPLE_MODULE_TYPES):
                return "simple"
            return "block"
        if node.op == "call_function":
            if node.target in _SIMPLE_FUNCTIONS:
                return "simple" if len(node.all_input_nodes) == 1 else "block"
            if node.target in _SCALAR_FUNCTIONS:
                return "simple" if len(node.all_input_nodes) == 1 else "block"
            return "block"
        if node.op == "call_method":
            return "simple" if node.target in _SIMPLE_METHODS and len(node.all_input_nodes) == 1 else "block"
        return "block"  # placeholder, get_attr, output

    kinds = {node: kind(node) for node in traced.graph.nodes}

    def channels(node: torch.fx.Node) -> tuple[int, int]:
        mod = modules[node.target]
        if isinstance(mod, nn.Linear):
            return mod.in_features, mod.out_features
        return mod.in_channels, mod.out_channels

    def norm_ok(norm: nn.Module, k: int, parent_is_linear: bool) -> bool:
        # A norm permutes with the channels only if it is per-channel along the channel dim.
        if isinstance(norm, nn.LayerNorm):
            return parent_is_linear and tuple(norm.normalized_shape) == (k,)
        return not parent_is_linear and getattr(norm, "num_features", None) == k

    # Walk back from each real node's input to its real parents.
    info: dict[str, dict[str, Any]] = {}
    real_nodes = [n for n in traced.graph.nodes if kinds[n] == "real"]
    for node in real_nodes:
        c, k = channels(node)
        parents: set[torch.fx.Node] = set()
        ok = len(node.all_input_nodes) == 1 and len(node.args) == 1 and not node.kwargs
        stack = list(node.all_input_nodes)
        while stack and ok:
            cur = stack.pop()
            if kinds[cur] == "real":
                parents.add(cur)
            elif kinds[cur] in ("simple", "norm") and len(cur.all_input_nodes) == 1:
                stack.extend(cur.all_input_nodes)
            else:
                ok = False
        info[node.target] = {"node": node, "module_type": type(modules[node.target]).__name__, "C": c, "K": k,
                             "real_parents": sorted(p.target for p in parents), "permutable_C": ok and bool(parents)}

    # Union children that share a parent.
    root: dict[str, str] = {}

    def find(x: str) -> str:
        while root.setdefault(x, x) != x:
            x = root[x]
        return x

    for name, entry in info.items():
        if entry["permutable_C"]:
            for p in entry["real_parents"]:
                root[find("P:" + p)] = find(name)
    members: dict[str, list[str]] = {}
    for name, entry in info.items():
        if entry["permutable_C"]:
            members.setdefault(find(name), []).append(name)

    groups, blocked = [], []
    for children in members.values():
        parents = sorted({p for ch in children for p in info[ch]["real_parents"]})
        c = info[children[0]]["C"]
        ok = all(info[ch]["C"] == c for ch in children) and all(info[p]["K"] == c for p in parents)
        passthru: list[str] = []
        # Forward closure of every parent: pass-through nodes only, ending at children of this group.
        for p in parents:
            if not ok:
                break
            parent_is_linear = isinstance(modules[p], nn.Linear)
            stack = list(info[p]["node"].users)
            while stack and ok:
                cur = stack.pop()
                kd = kinds[cur]
                if kd == "real":
                    ok = cur.target in children
                elif kd == "simple":
                    stack.extend(cur.users)
                elif kd == "norm" and norm_ok(modules[cur.target], c, parent_is_linear):
                    passthru.append(cur.target)
                    stack.extend(cur.users)
                else:
                    ok = False
        if ok:
            groups.append({"children": sorted(children), "parents": parents, "passthru": sorted(set(passthru)), "C": c})
        else:
            blocked.extend(f"{ch}_C" for ch in children)
    blocked.extend(f"{name}_C" for name, entry in info.items() if not entry["permutable_C"])
    graph: dict[str, Any] = {name: {k: v for k, v in entry.items() if k != "node"} for name, entry in info.items()}
    graph["sibling_groups"] = groups
    graph["blocked"] = sorted(blocked)
    return graph


def convert_fx_node_name(fx_node_name: str) -> str:
    """An FX node's name in module-name punctuation (FX writes ``layer1_0_conv1`` for ``layer1.0.conv1``):
    every ``_`` becomes ``.``."""
    return fx_node_name.replace("_", ".")


def get_node_parent_children(fx_node: torch.fx.Node) -> tuple[list[str], list[str]]:
    """Names (through ``convert_fx_node_name``) of the direct inputs and of the users of ``fx_node``."""
    parents = [convert_fx_node_name(n.name) for n in fx_node.all_input_nodes]
    children = [convert_fx_node_name(n.name) for n in fx_node.users]
    return parents, children
