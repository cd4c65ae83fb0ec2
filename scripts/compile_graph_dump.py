"""Dump the Inductor output code of one compiled culmen LLaMA block step (GPU machine), to see which kernels
and copies surround culmen's ops under ``torch.compile``.

    python3 scripts/compile_graph_dump.py OUT_DIR [size]

Writes ``OUT_DIR/fwd.py`` / ``bwd.py`` (the ``call`` functions of the forward and backward graphs: kernel
launches, buffer allocations and the custom-op calls, in order) for the culmen LLaMA model of
``culmen.bench.models`` with one layer.
"""

from __future__ import annotations

import glob
import os
import re
import sys

import torch

from culmen.bench.models import build_model, make_batch, model_config, with_overrides


def main() -> None:
    out = sys.argv[1]
    size = sys.argv[2] if len(sys.argv) > 2 else "d512"
    os.makedirs(out, exist_ok=True)
    cache = os.path.join(out, "inductor-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    cfg = with_overrides(model_config("llama", size), layers=1)
    dev = torch.device("cuda")
    tokens, labels = make_batch(cfg, dev)
    model = build_model(cfg, "culmen", dev, torch.bfloat16)
    torch.compile(model)(tokens, labels).backward()
    torch.cuda.synchronize()
    files = sorted(glob.glob(os.path.join(cache, "**", "*.py"), recursive=True), key=os.path.getmtime)
    graphs = [f for f in files if "def call(" in open(f).read()]
    for name, path in zip(("fwd", "bwd"), graphs[-2:]):
        text = open(path).read()
        body = text[text.index("def call("):]
        body = body[:body.index("\n\n\n")] if "\n\n\n" in body else body
        kernels = set(re.findall(r"(triton_\w+)\.run\(", body))
        heads = [m for m in re.findall(r"\n(# kernel path.*?\n(?:#.*\n)*)", text)]
        with open(os.path.join(out, f"{name}.py"), "w") as f:
            f.write(body + "\n\n# ---- kernel source comments (topologically sorted source nodes) ----\n")
            for line in text.splitlines():
                if line.startswith("# Topologically Sorted") or line.startswith("# Original ATen") or \
                        ("def triton_" in line and any(k in line for k in kernels)):
                    f.write(line + "\n")
        print(name, path, len(kernels), "kernels", len(heads))


if __name__ == "__main__":
    main()
