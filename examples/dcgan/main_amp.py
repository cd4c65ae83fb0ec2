"""DCGAN with culmen's amp: two models, two fused optimizers and three losses, each with its own loss scaler.

The GAN example Apex's README points to (``examples/dcgan``), written for culmen. ``amp.initialize``
takes both networks and both optimizers at once and ``num_losses=3``; each loss is scaled with its own
``loss_id`` (the discriminator's real and fake halves, the generator's loss), so an overflow in one
does not lower the scale of the others. The losses are ``BCEWithLogitsLoss`` (the discriminator
returns logits): ``BCELoss`` on probabilities is not safe in fp16, and amp's O1 refuses it.

    python examples/dcgan/main_amp.py --dataset fake --niter 1 --opt_level O1
    python examples/dcgan/main_amp.py --dataset folder --dataroot /data/celeba --imageSize 64 --opt_level O2
    python examples/dcgan/main_amp.py --dataset cifar10 --dataroot /data/cifar10 --imageSize 32   # torchvision

``--dataset fake`` makes images on the fly (no files, no torchvision); ``folder``, ``cifar10``, ``mnist``
and ``lsun`` read torchvision data sets. ``--optimizer`` picks culmen's ``FusedAdam`` (default), or
``FusedLAMB`` / ``torch.optim.Adam`` for comparison. Every epoch writes ``netG_epoch_<n>.pth``,
``netD_epoch_<n>.pth`` and a tensor of generated samples (``fake_samples_epoch_<n>.pt``, plus a PNG
grid when torchvision is installed) to ``--outf``. Prints ``RESULT {json}`` last: the final losses,
D(x), D(G(z)) and the three loss scales.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from culmen import amp
from culmen.optimizers import FusedAdam, FusedLAMB

try:
    import torchvision
    import torchvision.transforms as T
except ImportError:  # --dataset fake runs without torchvision
    torchvision = None


# --------------------------------------------------------------------------------------------- data


class FakeImages(Dataset):
    """``n`` random images in ``[-1, 1]`` with some spatial structure (blurred noise), made on demand."""

    def __init__(self, n: int, size: int, channels: int, seed: int = 0) -> None:
        self.n, self.size, self.channels, self.seed = n, size, channels, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        coarse = torch.rand(1, self.channels, max(2, self.size // 4), max(2, self.size // 4), generator=g)
        img = nn.functional.interpolate(coarse, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return img[0] * 2 - 1, 0


def make_dataset(opt) -> tuple[Dataset, int]:
    """``(dataset, channels)`` for ``--dataset``."""
    if opt.dataset == "fake":
        return FakeImages(opt.fake_size, opt.imageSize, 3, opt.manualSeed), 3
    if torchvision is None:
        raise SystemExit(f"--dataset {opt.dataset} needs torchvision (pip install torchvision); --dataset fake "
                         "works without it")
    if not opt.dataroot:
        raise SystemExit(f"--dataset {opt.dataset} needs --dataroot")
    norm3 = T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    resize = [T.Resize(opt.imageSize), T.CenterCrop(opt.imageSize), T.ToTensor()]
    if opt.dataset == "folder":
        return torchvision.datasets.ImageFolder(opt.dataroot, T.Compose([*resize, norm3])), 3
    if opt.dataset == "lsun":
        classes = [c + "_train" for c in opt.classes.split(",")]
        return torchvision.datasets.LSUN(opt.dataroot, classes=classes, transform=T.Compose([*resize, norm3])), 3
    if opt.dataset == "cifar10":
        return torchvision.datasets.CIFAR10(opt.dataroot, download=True, transform=T.Compose([*resize, norm3])), 3
    if opt.dataset == "mnist":
        return torchvision.datasets.MNIST(opt.dataroot, download=True,
                                          transform=T.Compose([*resize, T.Normalize((0.5,), (0.5,))])), 1
    raise SystemExit(f"unknown --dataset {opt.dataset}")


# ------------------------------------------------------------------------------------------- models


def _depth(image_size: int) -> int:
    """Number of stride-2 (de)convolutions between a 4x4 map and ``image_size`` (a power of two >= 8)."""
    if image_size < 8 or image_size & (image_size - 1):
        raise SystemExit(f"--imageSize must be a power of two >= 8, got {image_size}")
    return image_size.bit_length() - 3


def weights_init(m: nn.Module) -> None:
    """DCGAN's initialization: N(0, 0.02) convolutions, N(1, 0.02) batch-norm scales, zero shifts."""
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    """``(N, nz, 1, 1)`` noise -> ``(N, nc, S, S)`` images in ``[-1, 1]``: a 4x4 map doubled until ``S``."""

    def __init__(self, nz: int, ngf: int, nc: int, image_size: int) -> None:
        super().__init__()
        depth = _depth(image_size)
        ch = ngf * 2 ** (depth - 1)
        layers: list[nn.Module] = [nn.ConvTranspose2d(nz, ch, 4, 1, 0, bias=False), nn.BatchNorm2d(ch), nn.ReLU(True)]
        for _ in range(depth - 1):
            layers += [nn.ConvTranspose2d(ch, ch // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch // 2), nn.ReLU(True)]
            ch //= 2
        layers += [nn.ConvTranspose2d(ch, nc, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    """``(N, nc, S, S)`` images -> ``(N,)`` logits (real > 0); no sigmoid, the loss applies it."""

    def __init__(self, ndf: int, nc: int, image_size: int) -> None:
        super().__init__()
        depth = _depth(image_size)
        layers: list[nn.Module] = [nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
        ch = ndf
        for _ in range(depth - 1):
            layers += [nn.Conv2d(ch, ch * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch * 2),
                       nn.LeakyReLU(0.2, inplace=True)]
            ch *= 2
        layers += [nn.Conv2d(ch, 1, 4, 1, 0, bias=False)]
        self.main = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1)


def make_optimizer(name: str, params, lr: float, beta1: float):
    if name == "fusedadam":
        return FusedAdam(params, lr=lr, betas=(beta1, 0.999), adam_w_mode=False, weight_decay=0.0)
    if name == "fusedlamb":
        return FusedLAMB(params, lr=lr, betas=(beta1, 0.999), weight_decay=0.0)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(beta1, 0.999))
    raise SystemExit(f"unknown --optimizer {name}")


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DCGAN with culmen amp (two models, two optimizers, three losses)")
    p.add_argument("--dataset", default="fake", choices=("fake", "folder", "cifar10", "mnist", "lsun"))
    p.add_argument("--dataroot", default="", help="path to the data set (not for fake)")
    p.add_argument("--classes", default="bedroom", help="comma-separated LSUN classes")
    p.add_argument("--workers", type=int, default=2, help="data loading processes")
    p.add_argument("--batchSize", type=int, default=64)
    p.add_argument("--imageSize", type=int, default=64, help="image side (a power of two >= 8)")
    p.add_argument("--nz", type=int, default=100, help="size of the latent vector")
    p.add_argument("--ngf", type=int, default=64, help="generator width")
    p.add_argument("--ndf", type=int, default=64, help="discriminator width")
    p.add_argument("--niter", type=int, default=25, help="epochs")
    p.add_argument("--max-iters", type=int, default=-1, help="stop each epoch after this many iterations")
    p.add_argument("--lr", type=float, default=0.0002)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--optimizer", default="fusedadam", choices=("fusedadam", "fusedlamb", "adam"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--netG", default="", help="generator checkpoint to start from")
    p.add_argument("--netD", default="", help="discriminator checkpoint to start from")
    p.add_argument("--outf", default=".", help="folder for samples and checkpoints")
    p.add_argument("--manualSeed", type=int, default=None)
    p.add_argument("--opt_level", default="O1", help="amp opt level: O0 ... O3, O4/O5 (bf16)")
    p.add_argument("--fake-size", type=int, default=512, help="images in --dataset fake")
    p.add_argument("--print-freq", type=int, default=10)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    opt = parse_args(argv)
    if opt.manualSeed is None:
        opt.manualSeed = random.randint(1, 10000)
    print(f"random seed: {opt.manualSeed}")
    random.seed(opt.manualSeed)
    torch.manual_seed(opt.manualSeed)
    if opt.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here; use --device cpu")
    device = torch.device(opt.device)
    outf = Path(opt.outf)
    outf.mkdir(parents=True, exist_ok=True)

    dataset, nc = make_dataset(opt)
    loader = DataLoader(dataset, batch_size=opt.batchSize, shuffle=True, num_workers=opt.workers, drop_last=True,
                        pin_memory=device.type == "cuda")
    netG = Generator(opt.nz, opt.ngf, nc, opt.imageSize).to(device)
    netD = Discriminator(opt.ndf, nc, opt.imageSize).to(device)
    netG.apply(weights_init)
    netD.apply(weights_init)
    if opt.netG:
        netG.load_state_dict(torch.load(opt.netG, map_location=device))
    if opt.netD:
        netD.load_state_dict(torch.load(opt.netD, map_location=device))
    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(min(opt.batchSize, 64), opt.nz, 1, 1, device=device)
    real_label, fake_label = 1.0, 0.0

    optimizerD = make_optimizer(opt.optimizer, netD.parameters(), opt.lr, opt.beta1)
    optimizerG = make_optimizer(opt.optimizer, netG.parameters(), opt.lr, opt.beta1)
    # Both models and both optimizers in one call; one loss scaler per loss.
    [netD, netG], [optimizerD, optimizerG] = amp.initialize([netD, netG], [optimizerD, optimizerG],
                                                            opt_level=opt.opt_level, num_losses=3)

    result: dict = {"opt_level": opt.opt_level, "optimizer": opt.optimizer, "iters": 0}
    for epoch in range(opt.niter):
        for i, (real, _) in enumerate(loader):
            if 0 <= opt.max_iters <= i:
                break
            real = real.to(device, non_blocking=True)
            b = real.shape[0]
            # (1) discriminator: maximize log D(x) + log(1 - D(G(z))), two losses, two scalers.
            netD.zero_grad()
            label = torch.full((b,), real_label, device=device)
            out = netD(real)
            errD_real = criterion(out, label)
            with amp.scale_loss(errD_real, optimizerD, loss_id=0) as scaled:
                scaled.backward()
            D_x = out.float().sigmoid().mean().item()

            noise = torch.randn(b, opt.nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            out = netD(fake.detach())
            errD_fake = criterion(out, label)
            with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as scaled:
                scaled.backward()
            D_G_z1 = out.float().sigmoid().mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            # (2) generator: maximize log D(G(z)), the third loss.
            netG.zero_grad()
            label.fill_(real_label)
            out = netD(fake)
            errG = criterion(out, label)
            with amp.scale_loss(errG, optimizerG, loss_id=2) as scaled:
                scaled.backward()
            D_G_z2 = out.float().sigmoid().mean().item()
            optimizerG.step()
            result["iters"] += 1
            if i % opt.print_freq == 0:
                print(f"[{epoch}/{opt.niter}][{i}/{len(loader)}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} "
                      f"D(x): {D_x:.4f} D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}", flush=True)
            result.update(loss_D=errD.item(), loss_G=errG.item(), D_x=D_x, D_G_z1=D_G_z1, D_G_z2=D_G_z2)
        with torch.no_grad():
            samples = netG(fixed_noise).float().cpu()
        torch.save(samples, outf / f"fake_samples_epoch_{epoch:03d}.pt")
        if torchvision is not None:
            torchvision.utils.save_image(samples, outf / f"fake_samples_epoch_{epoch:03d}.png", normalize=True)
        torch.save(netG.state_dict(), outf / f"netG_epoch_{epoch}.pth")
        torch.save(netD.state_dict(), outf / f"netD_epoch_{epoch}.pth")
    result["loss_scales"] = [s.loss_scale() for s in amp._amp_state.loss_scalers]
    result["samples_shape"] = list(samples.shape)
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
