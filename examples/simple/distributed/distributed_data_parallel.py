"""The smallest data-parallel training with culmen: amp + ``culmen.parallel.DistributedDataParallel``.

The example Apex's README points to (``examples/simple/distributed``), written for culmen: one linear
layer fitted to random targets with an MSE loss, on every process of a ``torchrun`` launch.

    torchrun --standalone --nproc_per_node 2 examples/simple/distributed/distributed_data_parallel.py
    python -m culmen.parallel.multiproc examples/simple/distributed/distributed_data_parallel.py   # one per GPU
    python examples/simple/distributed/distributed_data_parallel.py --device cpu      # a single process

Each rank draws its own batch (seeded by rank) and starts from the same weights (DDP broadcasts rank
0's); the all-reduced gradients keep the weights identical on every rank, which the script checks at
the end. NCCL on GPUs, gloo with ``--device cpu``. Prints ``RESULT {json}`` last on every rank: first and
final loss, the largest weight difference between ranks (0 when DDP works) and a weight checksum.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from culmen import amp
from culmen.parallel import DistributedDataParallel


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # torch.distributed.launch passes --local_rank (or --local-rank); torchrun sets LOCAL_RANK.
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--opt-level", default="O1", help="amp opt level (O0 ... O5)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=64, help="N: rows per rank")
    p.add_argument("--d-in", type=int, default=1024)
    p.add_argument("--d-out", type=int, default=16)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU here; use --device cpu")
        torch.cuda.set_device(args.local_rank)
        device = torch.device("cuda", args.local_rank)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(1234 + rank)  # a different batch on every rank
    x = torch.randn(args.batch, args.d_in, device=device)
    y = torch.randn(args.batch, args.d_out, device=device)
    torch.manual_seed(0)  # ... and (broadcast anyway) the same initial weights
    model = torch.nn.Linear(args.d_in, args.d_out).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    if distributed:
        model = DistributedDataParallel(model)
    loss_fn = torch.nn.MSELoss()

    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())

    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    spread = 0.0
    if distributed:
        hi, lo = weights.clone(), weights.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        spread = float((hi - lo).max())
    print(f"rank {rank}/{world}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, weight spread across ranks {spread:.3g}")
    result = {"rank": rank, "world": world, "first_loss": losses[0], "final_loss": losses[-1],
              "weight_spread": spread, "checksum": float(weights.double().sum())}
    print("RESULT " + json.dumps(result), flush=True)
    if distributed:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
