"""The culmen versions of Apex's examples (``examples/``) run and train, on the CPU in seconds.

Each script runs as a user runs it (a subprocess; ``torchrun`` with gloo for two processes) on tiny
synthetic data and prints ``RESULT {json}`` lines that the tests check: the loss falls, ranks end with
identical weights, checkpoints resume, the GAN keeps one loss scaler per loss. GPU-marked variants run
the same scripts with ``--device cuda`` (and NCCL when there are two GPUs).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
IMAGENET = EXAMPLES / "imagenet" / "main_amp.py"
DCGAN = EXAMPLES / "dcgan" / "main_amp.py"
SIMPLE_DDP = EXAMPLES / "simple" / "distributed" / "distributed_data_parallel.py"
TIMEOUT = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks on a 2-core CI machine
    return env


def _run(args: list[str], cwd: Path, torchrun: int = 0) -> list[dict]:
    """Run a script (under ``torchrun --nproc_per_node torchrun`` when > 0); return its RESULT records by rank."""
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    proc = subprocess.run(cmd + [str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    # Ranks share one stdout: a RESULT record (printed with one write, so never split) may sit between other
    # ranks' partial lines, so each is decoded where it starts and ends where its JSON ends.
    results, dec, text = [], json.JSONDecoder(), proc.stdout
    pos = text.find("RESULT {")
    while pos >= 0:
        record, end = dec.raw_decode(text, pos + len("RESULT "))
        results.append(record)
        pos = text.find("RESULT {", end)
    assert results, log[-6000:]
    return sorted(results, key=lambda r: r.get("rank", 0))


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fake_imagenet(tmp_path_factory):
    pytest.importorskip("PIL")  # the example reads images with Pillow (torchvision needs it too)
    maker = _load(EXAMPLES / "imagenet" / "make_fake_imagefolder.py", "make_fake_imagefolder")
    return maker.make_imagefolder(tmp_path_factory.mktemp("fake_imagenet"), classes=4, train=16, val=4, size=24)


def test_fake_imagefolder_layout(fake_imagenet):
    from PIL import Image

    for split, count in (("train", 16), ("val", 4)):
        classes = sorted(p.name for p in (fake_imagenet / split).iterdir())
        assert classes == [f"class_{i}" for i in range(4)]
        for c in classes:
            files = sorted((fake_imagenet / split / c).glob("*.jpg"))
            assert len(files) == count
    img = Image.open(next((fake_imagenet / "train" / "class_0").glob("*.jpg")))
    assert img.size == (24, 24) and img.mode == "RGB"


IMAGENET_ARGS = ["-a", "small_cnn", "--image-size", "16", "-j", "0", "--lr", "0.8", "-p", "2", "--seed", "1",
                 "--device", "cpu"]


def test_imagenet_amp_trains_checkpoints_resumes_and_evaluates(fake_imagenet, tmp_path):
    out = tmp_path / "ckpt"
    (first,) = _run([IMAGENET, *IMAGENET_ARGS, "-b", "8", "--epochs", "2", "--opt-level", "O1", "--output", out,
                     fake_imagenet], tmp_path)
    e0, e1 = first["epochs"]
    assert first["steps"] == 2 * (64 // 8)
    assert math.isfinite(e0["train_loss"]) and e1["train_loss"] < e0["train_loss"]
    assert e1["prec1"] > 25.0  # above chance (4 classes)
    assert (out / "checkpoint.pth.tar").is_file() and (out / "model_best.pth.tar").is_file()
    ckpt = torch.load(out / "checkpoint.pth.tar", weights_only=False)
    assert ckpt["epoch"] == 2 and "amp" in ckpt and "loss_scaler0" in ckpt["amp"]

    # Resume: the amp state, optimizer and weights come back; training goes on from epoch 2.
    (resumed,) = _run([IMAGENET, *IMAGENET_ARGS, "-b", "8", "--epochs", "3", "--opt-level", "O1", "--output", out,
                       "--resume", out / "checkpoint.pth.tar", fake_imagenet], tmp_path)
    assert [e["epoch"] for e in resumed["epochs"]] == [2] and resumed["steps"] == 64 // 8
    # Evaluation of the saved weights reproduces the last validation.
    (evaluated,) = _run([IMAGENET, *IMAGENET_ARGS, "-b", "8", "--opt-level", "O1", "--evaluate",
                         "--resume", out / "checkpoint.pth.tar", fake_imagenet], tmp_path)
    assert evaluated["prec1"] == pytest.approx(resumed["epochs"][-1]["prec1"])


def test_imagenet_amp_ddp_two_processes(fake_imagenet, tmp_path):
    """DDP (gloo) with amp O1: the ranks train on different shards and end with identical weights."""
    results = _run([IMAGENET, *IMAGENET_ARGS, "-b", "4", "--epochs", "2", "--opt-level", "O1", "--no-checkpoint",
                    fake_imagenet], tmp_path, torchrun=2)
    assert [r["rank"] for r in results] == [0, 1] and all(r["world"] == 2 for r in results)
    assert results[0]["param_checksum"] == results[1]["param_checksum"]
    assert results[0]["steps"] == 2 * (64 // (2 * 4))
    e0, e1 = results[0]["epochs"]
    assert e1["train_loss"] < e0["train_loss"]


def test_imagenet_amp_ddp_syncbn_two_processes(fake_imagenet, tmp_path):
    """The example's full set: amp O1 + DDP + convert_syncbn_model, two gloo ranks."""
    results = _run([IMAGENET, *IMAGENET_ARGS, "-b", "4", "--epochs", "2", "--opt-level", "O1", "--sync_bn",
                    "--no-checkpoint", fake_imagenet], tmp_path, torchrun=2)
    assert results[0]["param_checksum"] == results[1]["param_checksum"]
    e0, e1 = results[0]["epochs"]
    assert e1["train_loss"] < e0["train_loss"]


DCGAN_ARGS = ["--dataset", "fake", "--fake-size", "32", "--batchSize", "8", "--imageSize", "16", "--nz", "16",
              "--ngf", "8", "--ndf", "8", "--niter", "2", "--workers", "0", "--device", "cpu", "--manualSeed", "1",
              "--print-freq", "2"]


@pytest.mark.parametrize("opt_level, optimizer", [("O1", "fusedadam"), ("O2", "fusedlamb")])
def test_dcgan_two_models_two_optimizers_three_losses(tmp_path, opt_level, optimizer):
    (res,) = _run([DCGAN, *DCGAN_ARGS, "--opt_level", opt_level, "--optimizer", optimizer, "--outf", tmp_path],
                  tmp_path)
    assert res["iters"] == 2 * (32 // 8)
    assert len(res["loss_scales"]) == 3  # num_losses=3: one dynamic scaler per loss_id
    assert all(s > 1.0 for s in res["loss_scales"])
    for key in ("loss_D", "loss_G"):
        assert math.isfinite(res[key]) and res[key] > 0
    for key in ("D_x", "D_G_z1", "D_G_z2"):
        assert 0.0 < res[key] < 1.0
    assert res["samples_shape"] == [8, 3, 16, 16]
    samples = torch.load(tmp_path / "fake_samples_epoch_001.pt")
    assert samples.shape == (8, 3, 16, 16) and samples.abs().max() <= 1.0 and samples.std() > 0
    # Both networks were trained: the epoch-1 weights differ from epoch 0's.
    for net in ("netG", "netD"):
        a = torch.load(tmp_path / f"{net}_epoch_0.pth")
        b = torch.load(tmp_path / f"{net}_epoch_1.pth")
        assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point()), net


def _simple_reference(world: int, batch: int, d_in: int, d_out: int, steps: int, lr: float) -> torch.Tensor:
    """Single-process SGD on the ranks' batches concatenated: what averaged DDP gradients must reproduce."""
    xs, ys = [], []
    for rank in range(world):
        torch.manual_seed(1234 + rank)
        xs.append(torch.randn(batch, d_in))
        ys.append(torch.randn(batch, d_out))
    x, y = torch.cat(xs), torch.cat(ys)
    torch.manual_seed(0)
    model = torch.nn.Linear(d_in, d_out)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_simple_distributed_matches_one_process_on_the_whole_batch(tmp_path):
    batch, d_in, d_out, steps, lr = 8, 32, 4, 20, 0.1
    results = _run([SIMPLE_DDP, "--device", "cpu", "--opt-level", "O0", "--steps", steps, "--lr", lr, "--batch",
                    batch, "--d-in", d_in, "--d-out", d_out], tmp_path, torchrun=2)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["weight_spread"] == 0.0 and r["final_loss"] < r["first_loss"]
    ref = _simple_reference(2, batch, d_in, d_out, steps, lr)
    assert results[0]["checksum"] == pytest.approx(float(ref.double().sum()), rel=1e-4, abs=1e-4)


def test_simple_distributed_single_process_amp(tmp_path):
    (res,) = _run([SIMPLE_DDP, "--device", "cpu", "--opt-level", "O1", "--steps", "30", "--lr", "0.1", "--batch",
                   "16", "--d-in", "64", "--d-out", "4"], tmp_path)
    assert res["world"] == 1 and res["final_loss"] < 0.8 * res["first_loss"]


def test_examples_say_plainly_when_cuda_is_missing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    proc = subprocess.run([sys.executable, SIMPLE_DDP, "--device", "cuda", "--steps", "1"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "no GPU here" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_imagenet_example_on_gpu(fake_imagenet, tmp_path, opt_level):
    args = [a if a != "cpu" else "cuda" for a in IMAGENET_ARGS]
    (res,) = _run([IMAGENET, *args, "-b", "8", "--epochs", "2", "--opt-level", opt_level, "--channels-last",
                   "--output", tmp_path, fake_imagenet], tmp_path)
    e0, e1 = res["epochs"]
    assert e1["train_loss"] < e0["train_loss"] and e1["prec1"] > 25.0


@pytest.mark.gpu
def test_imagenet_example_ddp_syncbn_on_two_gpus(fake_imagenet, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL)")
    args = [a if a != "cpu" else "cuda" for a in IMAGENET_ARGS]
    results = _run([IMAGENET, *args, "-b", "4", "--epochs", "2", "--opt-level", "O1", "--sync_bn", "--no-checkpoint",
                    fake_imagenet], tmp_path, torchrun=2)
    assert results[0]["param_checksum"] == pytest.approx(results[1]["param_checksum"], rel=0, abs=0)


@pytest.mark.gpu
@pytest.mark.parametrize("opt_level, optimizer", [("O1", "fusedadam"), ("O2", "fusedadam"), ("O1", "fusedlamb")])
def test_dcgan_example_on_gpu(tmp_path, opt_level, optimizer):
    args = [a if a != "cpu" else "cuda" for a in DCGAN_ARGS]
    (res,) = _run([DCGAN, *args, "--opt_level", opt_level, "--optimizer", optimizer, "--outf", tmp_path], tmp_path)
    assert len(res["loss_scales"]) == 3 and math.isfinite(res["loss_D"]) and math.isfinite(res["loss_G"])


@pytest.mark.gpu
def test_simple_distributed_on_gpus(tmp_path):
    n = min(torch.cuda.device_count(), 2)
    results = _run([SIMPLE_DDP, "--device", "cuda", "--steps", "50", "--lr", "0.05"], tmp_path,
                   torchrun=n if n > 1 else 0)
    for r in results:
        assert r["weight_spread"] == 0.0 and r["final_loss"] < r["first_loss"]
