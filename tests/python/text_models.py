"""Tiny Hugging Face models built from configs (no download) and token-sequence data, as
the ecosystem and recipe tests use them."""

import torch


class TokenSequences(torch.utils.data.Dataset):
    """``n`` sequences of 3 to 24 random token ids (1..vocab-1; 0 is padding) with labels
    0..classes-1: ``{"input_ids": LongTensor[L], "label": int}``, as a tokenized text
    data set serves them."""

    def __init__(self, n=40, vocab=100, classes=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 25, (n,), generator=g).tolist()
        self.ids = [torch.randint(1, vocab, (k,), generator=g) for k in lengths]
        self.labels = torch.randint(0, classes, (n,), generator=g).tolist()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "label": self.labels[i]}


# 11 examples of TokenSequences(): the workers' shards are unequal (6 and 5), and the
# longest sequence is in one shard only, so a worker pads its shard to another length than
# the whole batch is padded to.
UNEVEN_BATCH = [5, 17, 2, 33, 8, 21, 0, 39, 12, 26, 14]


def pad_collate(examples):
    """Pads to the batch's longest sequence: the dict of keyword arguments the model takes."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, e in enumerate(examples):
        ids[k, : len(e["input_ids"])] = e["input_ids"]
        mask[k, : len(e["input_ids"])] = 1
    labels = torch.tensor([e["label"] for e in examples], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lm_collate(examples):
    """Right-padded ids, their mask, and labels that are the ids with -100 at the padding,
    as Hugging Face's language-modelling collators make them."""
    batch = pad_collate(examples)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
    }


def token_tag_collate(examples, tags=3):
    """Padded ids with one label per token (its id modulo ``tags``; -100 at the padding), as
    a token classification data set gives them."""
    batch = lm_collate(examples)
    labels = batch["labels"]
    batch["labels"] = torch.where(labels == -100, labels, labels % tags)
    return batch


def _bert_config(transformers, labels=3):
    return transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def tiny_bert(transformers):
    """A sequence classifier: its ``outputs.loss`` is the mean over examples."""
    return transformers.BertForSequenceClassification(_bert_config(transformers))


def tiny_bert_tagger(transformers):
    """A token classifier (an encoder whose labels align with its logits): its
    ``outputs.loss`` is the mean over the tokens not labelled -100."""
    return transformers.BertForTokenClassification(_bert_config(transformers))


def tiny_gpt2(transformers):
    """A causal LM: its ``outputs.loss`` shifts the labels by one and is the mean over the
    tokens not labelled -100."""
    config = transformers.GPT2Config(
        vocab_size=100,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)
