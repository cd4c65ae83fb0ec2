"""The ``culmen`` command: ``culmen info``, ``culmen bench``, ``culmen demo``.

Also reachable as ``python -m culmen``.
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import TextIO

import torch


def _versions() -> list[tuple[str, str]]:
    import culmen

    rows = [("culmen", culmen.__version__), ("python", platform.python_version()), ("torch", torch.__version__)]
    try:
        import triton

        rows.append(("triton", triton.__version__))
    except Exception as exc:  # triton is optional off Linux, and a broken install must still report
        rows.append(("triton", f"not available ({type(exc).__name__})"))
    try:
        import numpy

        rows.append(("numpy", numpy.__version__))
    except ImportError:
        rows.append(("numpy", "not installed"))
    return rows


def _devices() -> tuple[list[str], torch.device | None]:
    if not torch.cuda.is_available():
        return ["cpu (no CUDA/ROCm device)"], None
    lines = []
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        kind = "ROCm" if torch.version.hip else "CUDA"
        lines.append(f"{kind} {i}: {torch.cuda.get_device_name(i)} (capability {cap[0]}.{cap[1]})")
    lines.append(f"{torch.cuda.device_count()} GPU(s); torch built for CUDA {torch.version.cuda or '-'}"
                 f", HIP {torch.version.hip or '-'}")
    return lines, torch.device("cuda", 0)


def _backend_for(device: torch.device) -> str:
    from culmen.ops.backend import choose_backend

    try:
        return choose_backend(device)
    except Exception as exc:  # e.g. CULMEN_BACKEND=triton on CPU without the interpreter: say why
        return f"error: {exc}"


def cmd_info(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print versions, devices, the dispatch mode and, per registered op, the backend it would use."""
    out = out or sys.stdout
    from culmen.ops import load_all
    from culmen.ops.backend import backend_mode, interpreter_enabled, registered_ops

    for name, version in _versions():
        print(f"{name:<8} {version}", file=out)
    dev_lines, cuda_dev = _devices()
    for line in dev_lines:
        print(f"device   {line}", file=out)
    try:
        mode = backend_mode()
    except ValueError as exc:
        print(f"CULMEN_BACKEND invalid: {exc}", file=out)
        return 2
    print(f"CULMEN_BACKEND={mode}  TRITON_INTERPRET={'on' if interpreter_enabled() else 'off'}", file=out)
    failed = load_all()
    for mod, err in failed.items():
        print(f"warning: op module {mod} failed to import: {err}", file=out)
    ops = registered_ops()
    cpu_backend = _backend_for(torch.device("cpu"))
    cuda_backend = _backend_for(cuda_dev) if cuda_dev is not None else "-"
    print(f"\n{len(ops)} registered op(s):", file=out)
    print(f"  {'op':<24} {'family':<16} {'cuda':<10} {'cpu':<10} description", file=out)
    for op in ops:
        print(f"  {op.name:<24} {op.family:<16} {cuda_backend:<10} {cpu_backend:<10} {op.description}", file=out)
    return 0


def cmd_bench(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run (or ``--list``) the registered benchmarks, or redraw a saved run (``--from-json``)."""
    out = out or sys.stdout
    from culmen.bench import load_benchmarks, registered_benchmarks, run_benchmarks

    if args.list:
        for mod, err in load_benchmarks().items():
            print(f"warning: benchmark module {mod} failed to import: {err}", file=out)
        for b in registered_benchmarks():
            print(f"{b.name:<26} {b.family:<14} {b.description}{'' if b.default else ' (run by name only)'}",
                  file=out)
        return 0
    if args.from_json:
        return _replot(args, out)
    from culmen.bench.runner import bench_device
    from culmen.bench.train_step import TrainOptionsError, options_from_args

    try:
        device = bench_device(args.device)
    except ValueError as exc:
        print(f"culmen bench: {exc}", file=sys.stderr)
        return 2
    try:
        run_benchmarks(args.names, device=device, quick=args.quick, json_path=args.json, graph=not args.no_graph,
                       plot_path=args.plot, out=out,
                       options={**options_from_args(args),
                                **({"model_cases": args.model_cases} if args.model_cases else {}),
                                **({"model_impls": args.model_impls} if args.model_impls else {})})
    except KeyError as exc:
        print(f"culmen bench: {exc.args[0]}", file=sys.stderr)
        return 2
    except TrainOptionsError as exc:
        print(f"culmen bench: {exc}", file=sys.stderr)
        return 2
    return 0


def _replot(args: argparse.Namespace, out: TextIO) -> int:
    """``culmen bench --from-json RUN.json --plot OUT.png``: draw a saved run again, running nothing."""
    from culmen.bench.plot import load_report, write_plot

    if not args.plot:
        print("culmen bench: --from-json draws a saved run; give --plot PATH too", file=sys.stderr)
        return 2
    if args.names or args.json:
        print("culmen bench: --from-json runs nothing; drop the benchmark names and --json", file=sys.stderr)
        return 2
    try:
        report = load_report(args.from_json)
    except (OSError, ValueError, TypeError) as exc:  # unreadable, not JSON, or not a bench report
        print(f"culmen bench: --from-json {args.from_json}: {exc}", file=sys.stderr)
        return 2
    return 0 if write_plot(report, args.plot, out) else 1


def cmd_demo(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Train the tiny demo model (``culmen/demo.py``)."""
    from culmen.demo import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``culmen`` command."""
    import culmen
    from culmen.bench.hf_models import add_arguments as add_model_arguments
    from culmen.bench.train_step import add_arguments as add_train_step_arguments
    from culmen.demo import add_arguments as add_demo_arguments

    parser = argparse.ArgumentParser(prog="culmen", description="culmen: Apex and FlashAttention in Python + Triton")
    parser.add_argument("--version", action="version", version=f"culmen {culmen.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench,demo}")
    sub.required = True

    p = sub.add_parser("info", help="versions, devices, backend dispatch per op")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bench", help="time culmen against PyTorch eager, torch.compile, Liger, Apex",
                       description="Time culmen against its peers in one process on the same inputs. Every ratio "
                                   "uses the eager wall time (do_bench of the plain call); CUDA-graph device time "
                                   "and host microseconds per call are printed beside it. train_step (end-to-end "
                                   "training of decoder models) runs only when named.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="benchmark names or families (default: all but train_step)")
    p.add_argument("--json", metavar="PATH", help="write records and metadata as JSON")
    p.add_argument("--plot", metavar="PATH",
                   help="draw PNGs (needs matplotlib): PATH gets an overview (one bar per benchmark), and "
                        "<stem>-<family>.png beside it one figure per family, each case's speed relative to "
                        "its best peer")
    p.add_argument("--from-json", metavar="JSON",
                   help="with --plot: draw the figures of a saved run (a --json file) instead of running")
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds on CPU): checks the harness")
    p.add_argument("--list", action="store_true", help="list the registered benchmarks and exit")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--no-graph", action="store_true",
                   help="skip the CUDA-graph (device time) column; ratios always use the eager wall time")
    add_train_step_arguments(p)
    add_model_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="train a tiny model with culmen's fused norms; the loss must fall")
    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``culmen`` / ``python -m culmen``; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)
