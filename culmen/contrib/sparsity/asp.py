"""Automatic SParsity (``apex.contrib.sparsity.asp``): prune a model to m:n (2:4) structured sparsity
and keep it pruned while it trains.

The recipe (Apex's)::

    ASP.init_model_for_pruning(model, "m4n2_1d", whitelist=[torch.nn.Linear], allow_recompute_mask=False)
    ASP.init_optimizer_for_pruning(optimizer)
    ASP.compute_sparse_masks()   # optional channel permutation, then masks; pruned weights become 0
    ... train / fine-tune: every optimizer.step() masks the gradients before and the weights after ...

or ``ASP.prune_trained_model(model, optimizer)`` for the three steps at once. Masks live in the model as
buffers ``__<param>_mma_mask`` (and, with ``allow_recompute_mask``, the pruned values in CPU buffers
``__<param>_mma_pruned_p``), so checkpoints carry them.

Differences from Apex, all in the direction of clearer failures: misuse (initialising twice, an
optimizer before the model, restoring without ``allow_recompute_mask``) raises ``RuntimeError`` where
Apex asserts; bad arguments raise ``ValueError`` / ``TypeError`` naming them; the permutation pass seeds
its own generator instead of the global RNGs and also reorders the optimizer's per-parameter state;
``ASP.reset()`` (culmen addition) forgets the current model so another can be pruned in the same process.
culmen's own keyword ``semi_structured=True`` runs the pruned ``Linear`` layers on PyTorch's
semi-structured sparse tensors where the GPU supports them (see ``culmen.contrib.sparsity.semi_structured``).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from culmen.contrib.sparsity import semi_structured as _semi
from culmen.contrib.sparsity.permutation_lib import Permutation
from culmen.contrib.sparsity.sparse_masklib import create_mask, parse_pattern

__all__ = ["ASP", "eligible_modules"]

_DEFAULT_WHITELIST = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.MultiheadAttention]


def _sparse_parameter_list() -> dict[type, list[str]]:
    """Module type -> names of the parameters ASP knows how to prune."""
    table: dict[type, list[str]] = {
        torch.nn.Linear: ["weight"], torch.nn.Conv1d: ["weight"], torch.nn.Conv2d: ["weight"],
        torch.nn.Conv3d: ["weight"],
        torch.nn.MultiheadAttention: ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_weight"],
    }
    ndq = getattr(torch.nn.modules.linear, "NonDynamicallyQuantizableLinear", None)
    if ndq is not None:
        table[ndq] = ["weight"]
    return table


def eligible_modules(model: nn.Module, whitelist_layer_types: tuple[type, ...],
                     allowed_layer_names: Sequence[str] | None,
                     disallowed_layer_names: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of a whitelisted type that the name lists admit."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, whitelist_layer_types) and name not in disallowed_layer_names:
            if allowed_layer_names is not None and name not in allowed_layer_names:
                continue
            out.append((name, mod))
    return out


class ASP:
    """Class-level ASP state and its steps (Apex's classmethod API; one model per process at a time)."""

    __model: nn.Module | None = None
    __verbosity = 0
    __optimizer: torch.optim.Optimizer | None = None
    __sparse_parameters: list[tuple[str, nn.Module, str, Tensor, Tensor, Tensor | None]] = []
    __calculate_mask: Callable[[Tensor], Tensor] | None = None
    __allow_permutation = True
    __all_parameters: list[tuple[str, nn.Module, str, Tensor]] = []
    __save_permutation_graph = False
    __permutation_output_dir = ""
    __semi_structured = False

    @classmethod
    def init_model_for_pruning(cls, model: nn.Module, mask_calculator: str | Callable[[Tensor], Tensor] = "m4n2_1d",
                               verbosity: int = 3, whitelist: Sequence[type] | None = None,
                               allowed_layer_names: Sequence[str] | None = None,
                               disallowed_layer_names: Sequence[str] = (), allow_recompute_mask: bool = False,
                               custom_layer_dict: dict[type, list[str]] | None = None,
                               allow_permutation: bool = True, *, semi_structured: bool = False) -> None:
        """Add mask buffers to the prunable parameters of ``model`` (sparsity stays off until
        ``compute_sparse_masks``).

        Args:
            model: the model (an ``nn.Module``; a DDP wrapper is fine).
            mask_calculator: a pattern name for ``create_mask`` (``"m4n2_1d"``, ``"m4n2_2d_best"``, ...)
                or a callable ``param -> mask`` (bool or 0/1 tensor of the parameter's shape).
            verbosity: 0 errors, 1 warnings, 2 info, 3 debug (prints one line per parameter).
            whitelist: module types to prune (default ``Linear``, ``Conv1d/2d/3d``,
                ``MultiheadAttention``).
            allowed_layer_names: if not None, only modules with these names are pruned.
            disallowed_layer_names: modules with these names are never pruned.
            allow_recompute_mask: keep the pruned values (in CPU memory) so that masks can be recomputed
                and ``restore_pruned_weights`` can bring back the dense weights.
            custom_layer_dict: extra ``{module type: [parameter names]}`` to prune.
            allow_permutation: search and apply an input-channel permutation before computing masks.
            semi_structured: (culmen) run pruned ``Linear`` layers with a 2:4 mask along their input dim
                on semi-structured sparse tensors where the GPU supports them.

        Parameters whose shape does not suit sparse tensor cores (rows not a multiple of 8 or input
        channels not a multiple of 16) are skipped, as in Apex.
        """
        if cls.__model is not None:
            raise RuntimeError("ASP has been initialized already (call ASP.reset() to start over)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(mask_calculator, str):
            parse_pattern(mask_calculator)  # a bad pattern fails here, naming it
            pattern = mask_calculator

            def calculate_mask(param: Tensor) -> Tensor:
                return create_mask(param, pattern).bool()
        elif callable(mask_calculator):
            calculate_mask = mask_calculator
        else:
            raise TypeError("mask_calculator must be a pattern string or a callable, got "
                            f"{type(mask_calculator).__name__}")
        if not isinstance(verbosity, int):
            raise TypeError(f"verbosity must be an int, got {type(verbosity).__name__}")
        whitelist = list(_DEFAULT_WHITELIST if whitelist is None else whitelist)
        if allowed_layer_names is not None and isinstance(allowed_layer_names, str):
            raise TypeError("allowed_layer_names must be a list of names, got a string")
        if isinstance(disallowed_layer_names, str):
            raise TypeError("disallowed_layer_names must be a list of names, got a string")
        table = _sparse_parameter_list()
        if custom_layer_dict:
            if not isinstance(custom_layer_dict, dict):
                raise TypeError(f"custom_layer_dict must be a dict, got {type(custom_layer_dict).__name__}")
            table.update(custom_layer_dict)
            whitelist = whitelist + [t for t in custom_layer_dict if t not in whitelist]
        for module_type in whitelist:
            if module_type not in table:
                raise ValueError(f"whitelist entry {module_type!r}: ASP does not know which parameters of this "
                                 "module type to sparsify (add it to custom_layer_dict)")

        cls.__model = model
        cls.__verbosity = verbosity
        cls.__calculate_mask = calculate_mask
        cls.__allow_permutation = bool(allow_permutation)
        cls.__semi_structured = bool(semi_structured)
        cls.__sparse_parameters = []
        cls.__all_parameters = []
        cls.__optimizer = None

        if allow_permutation:
            for module_name, module in model.named_modules():
                if isinstance(module, nn.Sequential) or module is model:
                    continue
                for p_name, p in module.named_parameters(recurse=False):
                    cls.__all_parameters.append((module_name, module, p_name, p))
                for b_name, b in module.named_buffers(recurse=False):
                    if b_name in ("running_mean", "running_var"):
                        cls.__all_parameters.append((module_name, module, b_name, b))
            cls.__permutation_output_dir = cls.__permutation_output_dir or "."
            Permutation.set_permutation_params_from_asp(cls.__model, cls.__sparse_parameters, cls.__all_parameters,
                                                        cls.__verbosity)
            Permutation.set_identical_seed()

        def add_sparse_attributes(module_name: str, module: nn.Module) -> None:
            names = table.get(type(module)) or next(v for k, v in table.items() if isinstance(module, k))
            for p_name, p in module.named_parameters(recurse=False):
                desc = f"{module_name}::{p_name} of size={list(p.size())} and type={p.dtype}"
                if p_name not in names or not p.requires_grad:
                    if verbosity >= 3:
                        print(f"[ASP] Not sparsifying {desc}")
                    continue
                if p.dim() < 2 or p.size(0) % 8 or p.size(1) % 16:
                    print(f"[ASP] Auto skipping pruning {desc} for sparsity")
                    continue
                if verbosity >= 3:
                    print(f"[ASP] Sparsifying {desc} for sparsity")
                mask = torch.ones_like(p, dtype=torch.bool)
                buffname = p_name.split(".")[-1]
                module.register_buffer(f"__{buffname}_mma_mask", mask)
                pruned = None
                if allow_recompute_mask:
                    pruned = torch.zeros_like(p, device="cpu")
                    module.register_buffer(f"__{buffname}_mma_pruned_p", pruned)
                cls.__sparse_parameters.append((module_name, module, p_name, p, mask, pruned))

        for name, module in eligible_modules(model, tuple(whitelist), allowed_layer_names, disallowed_layer_names):
            add_sparse_attributes(name, module)

    @classmethod
    def already_init_asp_model(cls) -> bool:
        """Whether ``init_model_for_pruning`` has been called (and not ``reset``)."""
        done = cls.__model is not None
        if cls.__verbosity >= 3:
            print("[ASP] ASP has been initialized already." if done else "[ASP] ASP has not been initialized.")
        return done

    @classmethod
    def init_optimizer_for_pruning(cls, optimizer: torch.optim.Optimizer) -> None:
        """Patch ``optimizer.step`` so gradients are masked before it and weights after it."""
        if cls.__optimizer is not None:
            raise RuntimeError("ASP has initialized optimizer already")
        if cls.__calculate_mask is None:
            raise RuntimeError("Called ASP.init_optimizer_for_pruning before ASP.init_model_for_pruning")
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have a step() method, got {type(optimizer).__name__}")
        cls.__optimizer = optimizer
        original_step = optimizer.step
        params = cls.__sparse_parameters

        def step(opt_self: Any, *args: Any, **kwargs: Any) -> Any:
            with torch.no_grad():
                for _, _, _, p, mask, _ in params:
                    if p.grad is not None:
                        p.grad.mul_(mask)
            result = original_step(*args, **kwargs)
            with torch.no_grad():
                for _, _, _, p, mask, _ in params:
                    p.mul_(mask)
            return result

        optimizer._culmen_asp_original_step = original_step
        optimizer.step = types.MethodType(step, optimizer)

    @classmethod
    def compute_sparse_masks(cls) -> None:
        """Enable sparsity: (optionally) permute input channels, compute every mask from the current
        weights, and zero the pruned weights in place. Recomputing masks that are already sparse needs
        ``allow_recompute_mask=True`` (the dense weights are restored first)."""
        if cls.__model is None:
            raise RuntimeError("Called ASP.compute_sparse_masks before ASP.init_model_for_pruning")
        with torch.no_grad():
            for module_name, _, p_name, p, mask, pruned in cls.__sparse_parameters:
                if not bool(mask.all()):
                    if pruned is None:
                        raise RuntimeError(f"Unable to restore dense parameter {module_name}::{p_name} because "
                                           "allow_recompute_mask == False")
                    p.add_(pruned.to(p.device))
                    pruned.zero_()
                    mask.fill_(True)
            if cls.__allow_permutation:
                inner = getattr(cls.__model, "module", None)
                target = inner if isinstance(inner, nn.Module) else cls.__model
                Permutation.set_permutation_params_from_asp(target, cls.__sparse_parameters, cls.__all_parameters,
                                                            cls.__verbosity)
                Permutation.permute_model(target, dump_fx_graph=cls.__save_permutation_graph,
                                          save_dumped_fx_graph=os.path.join(cls.__permutation_output_dir or ".",
                                                                            "model_offline_permutation_graph.json"))
                cls._permute_optimizer_state()
            for module_name, module, p_name, p, mask, pruned in cls.__sparse_parameters:
                new_mask = cls.__calculate_mask(p)
                if tuple(new_mask.shape) != tuple(p.shape):
                    raise ValueError(f"mask_calculator returned shape {tuple(new_mask.shape)} for "
                                     f"{module_name}::{p_name} of shape {tuple(p.shape)}")
                mask.copy_(new_mask.to(device=mask.device, dtype=torch.bool))
                if pruned is not None:
                    pruned.copy_((p * ~mask).cpu())
                p.mul_(mask)
                if cls.__verbosity >= 2:
                    sparsity = 100.0 - 100.0 * float(mask.sum()) / mask.numel()
                    print(f"[ASP] Enabled {sparsity:.2f}% sparsity for {module_name}::{p_name} of "
                          f"size={list(p.size())} and type={p.dtype}")
                if cls.__semi_structured and isinstance(module, nn.Linear) and p_name == "weight":
                    active = _semi.enable_semi_structured(module)
                    if cls.__verbosity >= 2:
                        print(f"[ASP] {module_name}: semi-structured sparse forward "
                              f"{'on' if active else _semi.semi_structured_status(module)}")

    @classmethod
    def _permute_optimizer_state(cls) -> None:
        # A permutation moves weights between channels; moments that stayed put would be wrong.
        opt = cls.__optimizer
        if opt is None:
            return
        for t, dim, order in Permutation.applied_permutations():
            state = opt.state.get(t) if isinstance(t, nn.Parameter) else None
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, Tensor) and value.shape == t.shape:
                    state[key] = value.index_select(dim, torch.as_tensor(order, device=value.device))

    @classmethod
    def restore_pruned_weights(cls) -> None:
        """Disable sparsity and restore the dense weights (needs ``allow_recompute_mask=True``)."""
        with torch.no_grad():
            for module_name, module, p_name, p, mask, pruned in cls.__sparse_parameters:
                _semi.disable_semi_structured(module)
                if not bool(mask.all()):
                    if pruned is None:
                        raise RuntimeError(f"Unable to restore dense parameter {module_name}::{p_name} because "
                                           "allow_recompute_mask == False")
                    p.add_(pruned.to(p.device))
                    mask.fill_(True)
                    pruned.zero_()
                    if cls.__verbosity >= 2:
                        print(f"[ASP] Disabled sparsity for {module_name}::{p_name} (dense weights restored)")

    @classmethod
    def is_sparsity_enabled(cls) -> bool:
        """True if every mask prunes something, False if none does (e.g. right after loading a
        checkpoint); ``RuntimeError`` if the model is partly sparse."""
        sparse = [not bool(mask.all()) for *_, mask, _ in cls.__sparse_parameters]
        if all(sparse) and sparse:
            return True
        if not any(sparse):
            return False
        raise RuntimeError("Inconsistent model sparsity: some masks are dense and some sparse")

    @classmethod
    def prune_trained_model(cls, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                            semi_structured: bool = False) -> None:
        """``init_model_for_pruning`` (2:4, ``Linear`` and ``Conv2d``, verbosity 2), then
        ``init_optimizer_for_pruning`` and ``compute_sparse_masks``."""
        cls.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2,
                                   whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=False,
                                   semi_structured=semi_structured)
        cls.init_optimizer_for_pruning(optimizer)
        cls.compute_sparse_masks()

    @classmethod
    def set_permutation_saving_params(cls, allow_permutation: bool = True, save_permutation_graph: bool = False,
                                      permutation_output_dir: str = ".") -> None:
        """Whether to permute, and whether / where to save the permutation graph as JSON."""
        cls.__allow_permutation = bool(allow_permutation)
        cls.__save_permutation_graph = bool(save_permutation_graph)
        cls.__permutation_output_dir = permutation_output_dir
        Permutation.set_permutation_saving_params(allow_permutation, save_permutation_graph, permutation_output_dir)

    @classmethod
    def sparse_parameters(cls) -> list[tuple[str, nn.Module, str, Tensor, Tensor, Tensor | None]]:
        """culmen addition: ``(module name, module, param name, param, mask, pruned or None)`` per
        pruned parameter."""
        return list(cls.__sparse_parameters)

    @classmethod
    def reset(cls) -> None:
        """culmen addition: undo the optimizer patch, drop the semi-structured forwards and forget the
        model, so ``init_model_for_pruning`` can be called again (mask buffers stay in the model)."""
        for _, module, *_ in cls.__sparse_parameters:
            _semi.disable_semi_structured(module)
        opt = cls.__optimizer
        if opt is not None and hasattr(opt, "_culmen_asp_original_step"):
            opt.step = opt._culmen_asp_original_step
            del opt._culmen_asp_original_step
        cls.__model = None
        cls.__optimizer = None
        cls.__calculate_mask = None
        cls.__sparse_parameters = []
        cls.__all_parameters = []
        cls.__allow_permutation = True
        cls.__semi_structured = False
        cls.__save_permutation_graph = False
        cls.__permutation_output_dir = ""
        Permutation.set_permutation_saving_params(False, False, ".")
