#!/usr/bin/env python3
"""Train a small Hugging Face BERT on a synthetic sentiment task, through shmgrad's eager
workers.

The task is generated here, with a seed: review sentences built from templates ("[CLS]
honestly the soundtrack was not very charming from start to finish") whose label is the
adjective's sentiment, flipped by a negation ("not", "never"). Optional clauses before
and after make the sentences 5 to 20 tokens long with [CLS], so padding matters. A
word-level vocabulary is built from the templates. The training split and the held-out
test split are disjoint sets of distinct sentences.

The model is ``transformers.BertForSequenceClassification`` built from a small
``BertConfig`` (2 layers of 4 heads, hidden size 64, no dropout, random initial weights:
nothing is downloaded). The data set is a map-style ``torch.utils.data.Dataset`` whose examples are
``{"input_ids": LongTensor[L], "label": int}``; ``pad_collate`` pads a batch to its
longest sentence and returns the model's keyword arguments (``input_ids``,
``attention_mask``, ``labels``), and ``forward`` returns the model's own loss, the mean
over the shard. ``shmgrad.Engine(..., loss_reduction="mean")`` weights each worker's
shard by its number of examples, so ``engine.gradient(idx, reduction="mean")`` is the
whole batch's mean gradient, as one process would compute it; ``torch.optim.AdamW``
updates the shared parameters (learning rate warmed up over the first tenth of the steps,
then decayed linearly). Each worker pads its own shard to the shard's longest
sentence, which is exact: the attention mask hides the padding.

Evaluation runs the bound model in the trainer, in eval mode, on the test split.

Measured on a 2-vCPU VM (AMD EPYC, Debian 12, torch 2.15.0, transformers 5.25.0) that
other people's builds shared, with the defaults (2 workers, 3 epochs of 4000 sentences,
batch 32): test accuracy 99.80% after the first epoch and 100.00% after the third,
1511-2066 examples/s, 6-8 s of training, 16-24 s in all (most of it the workers'
start-up: each imports transformers). The model is so small that the step's fixed cost
dominates: one process with one thread trains it at about 2250 examples/s on the same
machine, so this example shows the API (dict batches, padding, a mean loss), not a
speed-up.

Run: .venv/bin/python examples/train_text.py [--epochs E] [--workers N]
     [--batch-size B] [--train-examples K]
"""

import argparse
import random
import sys
import time

import torch
import transformers

import shmgrad

# -- the synthetic task --------------------------------------------------------------------
PAD, CLS = "[PAD]", "[CLS]"
SUBJECTS = [
    "the movie",
    "this film",
    "the plot",
    "the acting",
    "the soundtrack",
    "the ending",
    "the book",
    "this novel",
    "the restaurant",
    "the food",
    "the service",
    "the hotel room",
    "this phone",
    "the battery life",
    "the screen",
    "the concert",
]
VERBS = ["was", "is", "seemed", "felt", "looked", "turned out"]
INTENSIFIERS = ["very", "really", "quite", "truly", "rather", "so"]
NEGATIONS = ["not", "never"]
POSITIVE = [
    "good",
    "great",
    "excellent",
    "wonderful",
    "brilliant",
    "delightful",
    "superb",
    "enjoyable",
    "charming",
    "fantastic",
]
NEGATIVE = [
    "bad",
    "awful",
    "terrible",
    "boring",
    "dull",
    "disappointing",
    "poor",
    "horrible",
    "mediocre",
    "annoying",
]
PREFIXES = [
    "honestly",
    "to be fair",
    "in my opinion",
    "i have to say that",
    "last weekend i thought",
    "according to my friends",
    "after waiting for an hour",
]
SUFFIXES = [
    "for the price",
    "compared to the last one",
    "from start to finish",
    "if you ask me",
    "and i told everyone about it",
    "even on a rainy sunday afternoon",
]


def vocabulary():
    """Word -> id: padding 0, [CLS] 1, then every word of the templates, sorted."""
    words = set()
    for group in (SUBJECTS, VERBS, INTENSIFIERS, NEGATIONS, POSITIVE, NEGATIVE, PREFIXES):
        for phrase in group:
            words.update(phrase.split())
    for phrase in SUFFIXES:
        words.update(phrase.split())
    return {w: i for i, w in enumerate([PAD, CLS] + sorted(words))}


def sentence(rng):
    """One review sentence and its label (1 positive, 0 negative)."""
    positive = rng.random() < 0.5
    negated = rng.random() < 0.4
    words = [CLS]
    if rng.random() < 0.5:
        words += rng.choice(PREFIXES).split()
    words += rng.choice(SUBJECTS).split() + rng.choice(VERBS).split()
    if negated:
        words.append(rng.choice(NEGATIONS))
    if rng.random() < 0.5:
        words.append(rng.choice(INTENSIFIERS))
    words.append(rng.choice(POSITIVE if positive else NEGATIVE))
    if rng.random() < 0.5:
        words += rng.choice(SUFFIXES).split()
    return " ".join(words), int(positive != negated)


def make_splits(train_examples, test_examples, seed):
    """Disjoint train and test sets of distinct sentences, the same for the same seed."""
    rng = random.Random(seed)
    seen, examples = set(), []
    while len(examples) < train_examples + test_examples:
        text, label = sentence(rng)
        if text not in seen:
            seen.add(text)
            examples.append((text, label))
    return examples[:train_examples], examples[train_examples:]


class Sentences(torch.utils.data.Dataset):
    """Tokenized sentences: ``{"input_ids": LongTensor[L], "label": int}``."""

    def __init__(self, examples, vocab):
        self.ids = [torch.tensor([vocab[w] for w in t.split()]) for t, _ in examples]
        self.labels = [label for _, label in examples]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "label": self.labels[i]}


def pad_collate(examples):
    """Pads to the batch's longest sentence: the keyword arguments of the model."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)  # 0 is [PAD]
    mask = torch.zeros_like(ids)
    for k, e in enumerate(examples):
        ids[k, : len(e["input_ids"])] = e["input_ids"]
        mask[k, : len(e["input_ids"])] = 1
    labels = torch.tensor([e["label"] for e in examples], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def forward(model, batch):
    """The model's own loss: the mean over the batch (declared with loss_reduction="mean")."""
    return model(**batch).loss


def small_bert(vocab_size, hidden=64):
    """2 layers of 4 heads, no dropout (the run is then the same however the batches are
    split over the workers, and it learns faster on this small task)."""
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        num_labels=2,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


def warmup_then_linear_decay(opt, total_steps, warmup=0.1):
    """The learning rate rises linearly over the first ``warmup`` of the steps, then falls
    linearly to 0, as BERT is usually trained."""
    rise = max(1, round(warmup * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / rise) * max(0.0, (total_steps - s) / total_steps)
    )


@torch.no_grad()
def accuracy(model, dataset, batch_size=256):
    model.eval()
    correct = 0
    for start in range(0, len(dataset), batch_size):
        batch = pad_collate(
            [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        )
        labels = batch.pop("labels")
        correct += int((model(**batch).logits.argmax(1) == labels).sum())
    model.train()
    return correct / len(dataset)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--train-examples", type=int, default=4000)
    ap.add_argument("--test-examples", type=int, default=500)
    ap.add_argument(
        "--lr", type=float, default=2e-3, help="AdamW's peak learning rate (linear warm-up, decay)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for flag in ("workers", "epochs", "batch_size", "train_examples", "test_examples"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.train_examples + args.test_examples > 100000:
        ap.error("--train-examples plus --test-examples must be at most 100000")
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the trainer steps the optimizer; the workers do the rest
    vocab = vocabulary()
    train, test = make_splits(args.train_examples, args.test_examples, args.seed)
    train_ds, test_ds = Sentences(train, vocab), Sentences(test, vocab)
    model = small_bert(len(vocab))
    n = len(train_ds)
    steps_per_epoch = (n + args.batch_size - 1) // args.batch_size
    lengths = [len(ids) for ids in train_ds.ids]
    print(
        f"synthetic sentiment: BERT ({sum(p.numel() for p in model.parameters())} parameters, "
        f"vocabulary {len(vocab)}), {n} training and {len(test_ds)} test sentences of "
        f"{min(lengths)}-{max(lengths)} tokens, {args.workers} eager workers, batch "
        f"{args.batch_size}, {args.epochs} epoch(s)",
        flush=True,
    )
    with shmgrad.Engine(
        model=model,
        workers=args.workers,
        dataset=train_ds,
        collate_fn=pad_collate,
        forward=forward,
        loss_reduction="mean",
        seed=args.seed,
    ) as engine:
        engine.bind(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        sched = warmup_then_linear_decay(opt, args.epochs * steps_per_epoch)
        train_s = 0.0
        for epoch in range(1, args.epochs + 1):
            perm = torch.randperm(n)
            loss_sum = 0.0
            t0 = time.perf_counter()
            for idx in perm.split(args.batch_size):
                stats = engine.gradient(idx, reduction="mean")
                opt.step()
                sched.step()
                loss_sum += stats.loss * len(idx)
            elapsed = time.perf_counter() - t0
            train_s += elapsed
            acc = accuracy(model, test_ds)  # the bound model, in eval mode
            print(
                f"epoch {epoch}: train loss {loss_sum / n:.4f}, test accuracy {acc * 100:.2f}%, "
                f"{n / elapsed:.0f} examples/s",
                flush=True,
            )
    print(
        f"done: test accuracy {acc * 100:.2f}%, {args.epochs * n / train_s:.0f} examples/s "
        f"over {train_s:.1f} s of training, {time.perf_counter() - start:.1f} s in all"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
