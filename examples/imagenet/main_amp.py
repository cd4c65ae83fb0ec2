"""Image classification on an ImageFolder with culmen's amp, DistributedDataParallel and SyncBatchNorm.

The training script Apex's README points to (``examples/imagenet/main_amp.py``), written for culmen:
``amp.initialize`` with an opt level, ``culmen.parallel.DistributedDataParallel``, optional
``convert_syncbn_model``, uint8 batches normalized on the device by a prefetcher, SGD with a warm-up
and step decay, top-1 / top-5 evaluation averaged over ranks, checkpoints that carry the amp state.

    # one process (GPU when there is one, else CPU)
    python examples/imagenet/main_amp.py -a resnet50 --opt-level O1 /data/imagenet
    # several GPUs (torchrun sets LOCAL_RANK / WORLD_SIZE)
    torchrun --standalone --nproc_per_node 8 examples/imagenet/main_amp.py --sync_bn --opt-level O2 /data/imagenet
    # a small synthetic data set to try it
    python examples/imagenet/make_fake_imagefolder.py /tmp/fake_imagenet
    python examples/imagenet/main_amp.py -a small_cnn --image-size 32 -b 8 --epochs 2 /tmp/fake_imagenet

``DATA`` holds ``train/<class>/*.jpg`` and ``val/<class>/*.jpg``. The ``-a`` choices are torchvision's
models when torchvision is installed, and ``small_cnn`` (a 4-layer CNN with batch norm) always;
without torchvision a minimal folder reader (Pillow) stands in for ``ImageFolder``. ``--device cpu``
runs everything on the CPU (gloo instead of NCCL for several processes).

Prints ``RESULT {json}`` as its last line: final train loss, top-1/top-5, steps and a checksum of the
parameters (equal on every rank when data parallelism works).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from culmen import amp
from culmen.parallel import DistributedDataParallel, convert_syncbn_model

try:
    import torchvision
    import torchvision.transforms as T
except ImportError:  # the example runs without torchvision: small_cnn and a Pillow folder reader
    torchvision = None

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")


# ------------------------------------------------------------------------------------------- models


class SmallCNN(nn.Module):
    """conv-bn-relu x4 with two stride-2 steps, global pooling and a linear head: any image size >= 8."""

    def __init__(self, num_classes: int = 1000, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        chans = [3, width, width, 2 * width, 2 * width]
        for i in range(4):
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, stride=2 if i in (1, 3) else 1, padding=1, bias=False),
                       nn.BatchNorm2d(chans[i + 1]), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(chans[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def model_names() -> list[str]:
    """``small_cnn`` and, with torchvision, its classification models (``resnet18``, ``resnet50`` ...)."""
    names = ["small_cnn"]
    if torchvision is not None:
        names += sorted(torchvision.models.list_models(module=torchvision.models))
    return names


def build_model(arch: str, num_classes: int) -> nn.Module:
    if arch == "small_cnn":
        return SmallCNN(num_classes)
    if torchvision is None:
        raise SystemExit(f"--arch {arch!r} needs torchvision (pip install torchvision); small_cnn works without it")
    if arch not in model_names():
        raise SystemExit(f"--arch {arch!r} is not a torchvision classification model")
    return torchvision.models.get_model(arch, num_classes=num_classes)


# --------------------------------------------------------------------------------------------- data


class FolderImages(Dataset):
    """``root/<class>/<image>`` with Pillow, the part of ``torchvision.datasets.ImageFolder`` used here.

    ``train=True``: random crop of 60-100% of the area (aspect 3/4 to 4/3), resized to ``size``, random
    horizontal flip; otherwise resize the short side to ``size * 8/7`` and take the centre crop.
    """

    def __init__(self, root: Path, size: int, train: bool) -> None:
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        if not self.classes:
            raise SystemExit(f"{root}: no class folders")
        self.samples = [(str(f), i) for i, c in enumerate(self.classes) for f in sorted((root / c).iterdir())
                        if f.suffix.lower() in IMAGE_EXTS]
        self.size, self.train = size, train

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        img = Image.open(path).convert("RGB")
        w, h = img.size
        if self.train:
            for _ in range(10):
                area = random.uniform(0.6, 1.0) * w * h
                ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
                cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
                if 0 < cw <= w and 0 < ch <= h:
                    x0, y0 = random.randint(0, w - cw), random.randint(0, h - ch)
                    img = img.crop((x0, y0, x0 + cw, y0 + ch))
                    break
            img = img.resize((self.size, self.size), Image.BILINEAR)
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            short = round(self.size * 8 / 7)
            scale = short / min(w, h)
            img = img.resize((max(short, round(w * scale)), max(short, round(h * scale))), Image.BILINEAR)
            w, h = img.size
            x0, y0 = (w - self.size) // 2, (h - self.size) // 2
            img = img.crop((x0, y0, x0 + self.size, y0 + self.size))
        return img, label


def datasets(root: Path, size: int):
    if torchvision is not None:
        train = torchvision.datasets.ImageFolder(
            root / "train", T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()]))
        val = torchvision.datasets.ImageFolder(root / "val", T.Compose([T.Resize(round(size * 8 / 7)),
                                                                        T.CenterCrop(size)]))
        return train, val
    return FolderImages(root / "train", size, True), FolderImages(root / "val", size, False)


def collate_uint8(batch, memory_format=torch.contiguous_format):
    """PIL images -> one uint8 ``(N, 3, H, W)`` tensor (normalized later, on the device) and int64 labels."""
    labels = torch.tensor([t for _, t in batch], dtype=torch.int64)
    w, h = batch[0][0].size
    out = torch.zeros((len(batch), 3, h, w), dtype=torch.uint8).contiguous(memory_format=memory_format)
    for i, (img, _) in enumerate(batch):
        arr = np.asarray(img, dtype=np.uint8)
        out[i] = torch.from_numpy(arr.copy()).permute(2, 0, 1)
    return out, labels


class Prefetcher:
    """Moves the next batch to the device and normalizes it (fp32) while the current one trains.

    On CUDA the copy and the normalization run on a side stream, and the consumer waits on it; on the
    CPU it is a plain iterator with the same arithmetic. Inputs stay fp32 at every opt level: amp casts
    them (O2/O3/O5 patch the model's forward, O1/O4 cast per op).
    """

    def __init__(self, loader, device: torch.device) -> None:
        self.it = iter(loader)
        self.device = device
        self.mean = torch.tensor([255 * m for m in MEAN], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([255 * s for s in STD], device=device).view(1, 3, 1, 1)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._load()

    def _load(self) -> None:
        try:
            x, y = next(self.it)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            x = x.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
            self.next = (x, y.to(self.device, non_blocking=True))

    def __iter__(self):
        return self

    def __next__(self):
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self.next is None:
            raise StopIteration
        x, y = self.next
        if self.stream is not None:  # the tensors are used on the main stream from now on
            x.record_stream(torch.cuda.current_stream(self.device))
            y.record_stream(torch.cuda.current_stream(self.device))
        self._load()
        return x, y


# ------------------------------------------------------------------------------------------ helpers


class Meter:
    """Running value and average."""

    def __init__(self) -> None:
        self.val = self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / max(self.count, 1)


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1, 5)) -> list[torch.Tensor]:
    """Percent of rows whose label is among the ``k`` highest logits, for each ``k`` (capped at the classes)."""
    maxk = min(max(topk), output.shape[1])
    pred = output.topk(maxk, 1, True, True).indices
    hit = pred.eq(target.view(-1, 1))
    return [hit[:, :min(k, maxk)].any(1).float().mean() * 100 for k in topk]


def reduce_mean(t: torch.Tensor, world: int) -> torch.Tensor:
    """Average of ``t`` over the ranks (a copy; ``t`` itself unchanged)."""
    t = t.detach().clone()
    if world > 1:
        dist.all_reduce(t)
        t /= world
    return t


def adjust_learning_rate(optimizer, base_lr: float, epoch: int, step: int, steps_per_epoch: int) -> float:
    """Linear warm-up over the first 5 epochs, then x0.1 at epochs 30, 60 and 80 (as the ResNet recipe)."""
    factor = 0.1 ** (epoch // 30 + (epoch >= 80))
    lr = base_lr * factor
    if epoch < 5:
        lr *= (1 + step + epoch * steps_per_epoch) / (5 * steps_per_epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def param_checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


# -------------------------------------------------------------------------------------------- train


def train_epoch(loader, model, criterion, optimizer, epoch, args, device, rank, world):
    model.train()
    losses, top1, batch_time = Meter(), Meter(), Meter()
    end = time.perf_counter()
    steps = len(loader)
    for i, (x, y) in enumerate(Prefetcher(loader, device)):
        if args.prof >= 0 and i >= args.prof:
            break
        lr = adjust_learning_rate(optimizer, args.lr, epoch, i, steps)
        out = model(x)
        loss = criterion(out, y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        args.global_steps += 1
        if i % args.print_freq == 0 or i == steps - 1:
            # Statistics are averaged over ranks only every print_freq steps: each reduction syncs.
            prec1, _ = accuracy(out.float(), y)
            loss_avg = float(reduce_mean(loss.float(), world))
            prec1 = float(reduce_mean(prec1, world))
            losses.update(loss_avg, x.shape[0])
            top1.update(prec1, x.shape[0])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            batch_time.update((time.perf_counter() - end) / (1 if i == 0 else args.print_freq))
            end = time.perf_counter()
            if rank == 0:
                print(f"Epoch [{epoch}][{i}/{steps}] lr {lr:.4g}  time {batch_time.val:.3f}s  "
                      f"speed {world * args.batch_size / max(batch_time.val, 1e-9):.1f} img/s  "
                      f"loss {loss_avg:.4f} ({losses.avg:.4f})  Prec@1 {prec1:.2f} ({top1.avg:.2f})", flush=True)
    return losses.avg


@torch.no_grad()
def validate(loader, model, criterion, device, world, rank):
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top1 hits, top5 hits, count
    for x, y in Prefetcher(loader, device):
        out = model(x).float()
        p1, p5 = accuracy(out, y)
        n = x.shape[0]
        totals += torch.tensor([float(criterion(out, y)) * n, float(p1) * n / 100, float(p5) * n / 100, n],
                               dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(totals)
    loss, hit1, hit5, n = totals.tolist()
    n = max(n, 1)
    if rank == 0:
        print(f" * Prec@1 {100 * hit1 / n:.3f} Prec@5 {100 * hit5 / n:.3f}  loss {loss / n:.4f}", flush=True)
    return 100 * hit1 / n, 100 * hit5 / n


def save_checkpoint(state: dict, is_best: bool, outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "checkpoint.pth.tar"
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, outdir / "model_best.pth.tar")


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="ImageFolder training with culmen amp + DDP + SyncBN")
    p.add_argument("data", metavar="DIR", help="folder with train/ and val/ class subfolders")
    p.add_argument("-a", "--arch", default="resnet18" if torchvision is not None else "small_cnn",
                   help=f"model: {', '.join(model_names()[:8])} ...")
    p.add_argument("-j", "--workers", default=4, type=int, help="data loading processes per rank")
    p.add_argument("--epochs", default=90, type=int)
    p.add_argument("--start-epoch", default=0, type=int, help="epoch number to start from (on --resume)")
    p.add_argument("-b", "--batch-size", default=256, type=int, help="per-process batch size")
    p.add_argument("--lr", "--learning-rate", default=0.1, type=float,
                   help="base learning rate for a global batch of 256 (scaled linearly with the global batch)")
    p.add_argument("--momentum", default=0.9, type=float)
    p.add_argument("--weight-decay", "--wd", default=1e-4, type=float)
    p.add_argument("--print-freq", "-p", default=10, type=int)
    p.add_argument("--resume", default="", metavar="PATH", help="checkpoint to resume from")
    p.add_argument("-e", "--evaluate", action="store_true", help="evaluate on the validation set and exit")
    p.add_argument("--prof", default=-1, type=int, help="stop each epoch after this many steps (profiling)")
    p.add_argument("--deterministic", action="store_true", help="seed everything, deterministic cuDNN")
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--local_rank", "--local-rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int)
    p.add_argument("--sync_bn", action="store_true", help="BatchNorm -> culmen SyncBatchNorm")
    p.add_argument("--opt-level", default="O1", type=str, help="amp opt level: O0 (fp32) ... O3, O4/O5 (bf16)")
    p.add_argument("--keep-batchnorm-fp32", default=None, type=str, help="True/False (amp override)")
    p.add_argument("--loss-scale", default=None, type=str, help='a number or "dynamic" (amp override)')
    p.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    p.add_argument("--image-size", default=224, type=int, help="training crop size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--output", default=".", help="folder for checkpoint.pth.tar / model_best.pth.tar")
    p.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    distributed = world > 1
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU here; use --device cpu")
        torch.cuda.set_device(args.local_rank)
        device = torch.device("cuda", args.local_rank)
        torch.backends.cudnn.benchmark = not args.deterministic
        torch.backends.cudnn.deterministic = args.deterministic
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    rank = dist.get_rank() if distributed else 0
    if args.deterministic or args.seed:
        random.seed(args.seed + rank)
        np.random.seed(args.seed + rank)
        torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts them)

    train_set, val_set = datasets(Path(args.data), args.image_size)
    num_classes = len(train_set.classes)
    model = build_model(args.arch, num_classes)
    if args.sync_bn:
        if rank == 0:
            print("using culmen SyncBatchNorm")
        model = convert_syncbn_model(model)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)

    # Linear scaling: --lr is for a global batch of 256.
    args.lr = args.lr * args.batch_size * world / 256.0
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
    if distributed:
        # delay_allreduce: one reduction per dtype after backward (no overlap), the safest setting.
        model = DistributedDataParallel(model, delay_allreduce=True)
    criterion = nn.CrossEntropyLoss().to(device)

    best_prec1 = 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        args.start_epoch = ckpt["epoch"]
        best_prec1 = ckpt["best_prec1"]
        (model.module if distributed else model).load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        amp.load_state_dict(ckpt["amp"])
        if rank == 0:
            print(f"resumed from {args.resume} (epoch {args.start_epoch})")

    train_sampler = DistributedSampler(train_set, seed=args.seed) if distributed else None
    val_sampler = DistributedSampler(val_set, shuffle=False) if distributed else None

    def collate(batch):
        return collate_uint8(batch, memory_format)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=train_sampler is None,
                              num_workers=args.workers, pin_memory=device.type == "cuda", sampler=train_sampler,
                              collate_fn=collate, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                            pin_memory=device.type == "cuda", sampler=val_sampler, collate_fn=collate)
    if len(train_loader) == 0:
        raise SystemExit(f"{args.data}/train has fewer images ({len(train_set)}) than one batch per rank")

    result = {"rank": rank, "world": world, "opt_level": args.opt_level, "arch": args.arch, "epochs": []}
    if args.evaluate:
        result["prec1"], result["prec5"] = validate(val_loader, model, criterion, device, world, rank)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    args.global_steps = 0
    for epoch in range(args.start_epoch, args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        loss = train_epoch(train_loader, model, criterion, optimizer, epoch, args, device, rank, world)
        prec1, prec5 = validate(val_loader, model, criterion, device, world, rank)
        result["epochs"].append({"epoch": epoch, "train_loss": loss, "prec1": prec1, "prec5": prec5})
        is_best = prec1 > best_prec1
        best_prec1 = max(prec1, best_prec1)
        if rank == 0 and not args.no_checkpoint:
            save_checkpoint({"epoch": epoch + 1, "arch": args.arch, "best_prec1": best_prec1,
                             "state_dict": (model.module if distributed else model).state_dict(),
                             "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
                            is_best, Path(args.output))
    result.update(steps=args.global_steps, best_prec1=best_prec1, param_checksum=param_checksum(model))
    print("RESULT " + json.dumps(result), flush=True)
    if distributed:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
