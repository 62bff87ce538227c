#!/usr/bin/env python3
"""Train a small ResNet with BatchNorm on Fashion-MNIST, with data augmentation run by
shmgrad's eager workers.

The model, the loss (label-smoothed cross entropy) and the dataset (a torch Dataset whose
__getitem__ applies torchvision's random crop, horizontal flip, ToTensor and Normalize to
one example) are plain PyTorch: nothing here is TorchScript. ``shmgrad.Engine`` pickles
them once; each step sends only the batch's indices, and each worker builds its share of
the batch itself -- the per-example transforms run in the workers, in parallel, seeded
with ``shmgrad.example_seed(step_seed, i)`` so that an example's crop and flip do not
depend on which worker took it. ``engine.gradient(idx, reduction="mean")`` fills the
bound model's ``.grad`` and ``torch.optim.SGD`` updates the shared parameters.

Evaluation runs the bound model in eval mode on the test split. ``engine.bind`` shares
the module's BatchNorm running statistics with the workers (after each step they are the
first worker's), so the trainer's module evaluates with no extra pass over the data.

Measured on a 2-vCPU VM (AMD EPYC, Debian 12, torch 1.13.1 CPU) that other people's
builds, tests and benchmarks shared, with the defaults (2 workers, one epoch of the 60000
training images, batch 128): test accuracy 86.02% (BatchNorm statistics recomputed),
914 examples/s, 66 s of training, 85 s in all. Step time outside the workers' compute
(transforms, forward, backward): 1.2%. See docs/GUIDE.md, "Eager and TorchScript workers".

Run: .venv/bin/python examples/train_augmented.py [--epochs E] [--workers N]
     [--batch-size B] [--train-examples K]
"""

import argparse
import os
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad  # noqa: E402
from fashion_mnist import accuracy, load_split  # noqa: E402

MEAN, STD = 0.2860, 0.3530  # of Fashion-MNIST's training pixels


def train_transform(padding=2):
    """What every training example goes through, one PIL image at a time."""
    return transforms.Compose(
        [
            transforms.RandomCrop(28, padding=padding),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((MEAN,), (STD,)),
        ]
    )


def as_images(x):
    """load_split's [N, 1, 28, 28] floats in [0, 1] back to [N, 28, 28] uint8 pixels (the
    loader divided them by 255: exact), a quarter of the memory each worker holds."""
    return (x[:, 0] * 255).round().to(torch.uint8).numpy()


class TransformedFashionMNIST(torch.utils.data.Dataset):
    """Fashion-MNIST as torchvision's datasets serve it: ``transform`` applied to one PIL
    image in ``__getitem__``. Every eager worker holds a copy (47 MB for all 60000
    images); see docs/GUIDE.md ("Batches and datasets") for datasets too large for that."""

    def __init__(self, images, labels, transform):
        self.images = images  # uint8 [N, 28, 28]
        self.labels = labels  # int64 [N]
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.images[i], mode="L")), int(self.labels[i])


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the input (a 1x1 conv + BN where the shape changes),
    then ReLU."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A stem and three stages of one basic block each (16, 32, 64 channels; 28, 14, 7
    pixels), global average pooling and a linear classifier: about 78k parameters."""

    def __init__(self, widths=(16, 32, 64), classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        stages, cin = [], widths[0]
        for k, w in enumerate(widths):
            stages.append(BasicBlock(cin, w, 1 if k == 0 else 2))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def smoothed_loss():
    return nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1)


def training_set(train_examples, padding, seed):
    """The first ``train_examples`` of a fixed shuffle of the 60000 training images, with
    the augmentation."""
    x, y = load_split("train")
    keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:train_examples]
    return TransformedFashionMNIST(as_images(x[keep]), y[keep].numpy(), train_transform(padding))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument(
        "--train-examples",
        type=int,
        default=60000,
        help="train on this many of the 60000 training images (default all)",
    )
    ap.add_argument("--lr", type=float, default=0.1, help="peak learning rate (one cycle)")
    ap.add_argument(
        "--padding", type=int, default=2, choices=(2, 4), help="random crop padding in pixels"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.train_examples <= 60000:
        ap.error("--train-examples must be in [1, 60000]")
    for flag in ("workers", "epochs", "batch_size"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the trainer steps the optimizer; the workers do the rest
    model = SmallResNet()
    dataset = training_set(args.train_examples, args.padding, args.seed)
    test_x, test_y = load_split("test")
    test_x = (test_x - MEAN) / STD
    n = len(dataset)
    steps_per_epoch = (n + args.batch_size - 1) // args.batch_size
    print(
        f"augmented Fashion-MNIST: SmallResNet ({sum(p.numel() for p in model.parameters())} "
        f"parameters), {n} training images, {args.workers} eager workers, batch "
        f"{args.batch_size}, {args.epochs} epoch(s)",
        flush=True,
    )
    with shmgrad.Engine(
        model=model, loss=smoothed_loss(), dataset=dataset, workers=args.workers, seed=args.seed
    ) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch
        )
        train_s = 0.0
        for epoch in range(1, args.epochs + 1):
            perm = torch.randperm(n)
            loss_sum = wall = compute = 0.0
            t0 = time.perf_counter()
            for step in range(steps_per_epoch):
                idx = perm[step * args.batch_size : (step + 1) * args.batch_size]
                s0 = time.perf_counter()
                stats = engine.gradient(idx, reduction="mean")  # transforms run in the workers
                opt.step()
                sched.step()
                wall += time.perf_counter() - s0
                compute += max(stats.compute_seconds)
                loss_sum += stats.loss_sum
                if (step + 1) % 100 == 0:
                    done = min((step + 1) * args.batch_size, n)
                    print(
                        f"  epoch {epoch} step {step + 1}/{steps_per_epoch} loss "
                        f"{loss_sum / done:.4f} {done / (time.perf_counter() - t0):.0f} ex/s",
                        flush=True,
                    )
            elapsed = time.perf_counter() - t0
            train_s += elapsed
            acc = accuracy(model, test_x, test_y)  # the bound model, in eval mode
            print(
                f"epoch {epoch}: test accuracy {acc * 100:.2f}%, {n / elapsed:.0f} "
                f"examples/s, train loss {loss_sum / n:.4f}, share of step time not in the "
                f"workers' compute (transforms, forward, backward) "
                f"{100 * (wall - compute) / wall:.1f}%",
                flush=True,
            )
        print(
            f"done: test accuracy {acc * 100:.2f}%, {args.epochs * n / train_s:.0f} examples/s "
            f"over {train_s:.0f} s of training"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
