"""Evaluate the shipped target and write its model card (``dspark_kernels/assets/README.md``) and ``metrics.json``.

Perplexity is measured by our runtime on a fixed evaluation set per domain: the first ``EVAL_BLOCKS`` blocks of
``EVAL_SEQ_LEN`` tokens of the domain's evaluation split (code and prose: validation; heldout: test), each document
wrapped in ``<|bos|> .. <|eos|>`` and concatenated. The test suite recomputes exactly this and compares with the card.

CLI: ``python -m dspark_kernels.train.model_card --model dspark_kernels/assets/target --corpus data/corpus``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import CausalLM, forward_sequences, generate, load_model
from .corpus import read_split
from .target import blocks, token_stream
from .tokenizer import BOS_ID, EOS_ID, load_tokenizer

EVAL_SPLITS = {"code": "validation", "prose": "validation", "heldout": "test"}
EVAL_BLOCKS = 24
EVAL_SEQ_LEN = 256
SAMPLE_PROMPTS = {
    "code": "import os\n\n\ndef read_config(path):\n",
    "code-class": "class Stack:\n    def __init__(self):\n",
    "prose": "The module provides",
}


@torch.no_grad()
def domain_nll(model: CausalLM, tokenizer, corpus_dir: Path, domain: str) -> tuple[float, int]:
    """Mean next-token NLL (nats) and the number of predicted tokens on the domain's fixed evaluation set."""
    data = blocks(token_stream(tokenizer, read_split(corpus_dir, domain, EVAL_SPLITS[domain])), EVAL_SEQ_LEN)
    data = data[:EVAL_BLOCKS]
    n = data.shape[0]
    logits = forward_sequences(model, data.tolist())[0].logits.view(n, EVAL_SEQ_LEN, -1)
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1), reduction="sum")
    count = n * (EVAL_SEQ_LEN - 1)
    return float(nll) / count, count


def evaluate(model: CausalLM, tokenizer, corpus_dir: Path) -> dict:
    out = {}
    for domain in EVAL_SPLITS:
        nll, count = domain_nll(model, tokenizer, corpus_dir, domain)
        out[domain] = {"nll": nll, "perplexity": math.exp(nll), "tokens": count}
    return out


def samples(model: CausalLM, tokenizer, max_new_tokens: int = 96) -> dict[str, str]:
    """Greedy continuations of fixed prompts (what a reader of the card can reproduce exactly)."""
    names = list(SAMPLE_PROMPTS)
    prompts = [[BOS_ID] + tokenizer.encode(SAMPLE_PROMPTS[k]).ids for k in names]
    res = generate(model, prompts, max_new_tokens, temperature=0.0, eos_token_id=EOS_ID)
    return {k: SAMPLE_PROMPTS[k] + tokenizer.decode(t) for k, t in zip(names, res.tokens)}


def write_card(model_dir: Path, corpus_dir: Path, train_summary: Path, out: Path, note: str = "") -> dict:
    model = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    metrics = {
        "params": sum(p.numel() for p in model.parameters()),
        "eval": evaluate(model, tokenizer, corpus_dir),
        "eval_set": {"blocks": EVAL_BLOCKS, "seq_len": EVAL_SEQ_LEN, "splits": EVAL_SPLITS},
        "training": json.loads(Path(train_summary).read_text()) if Path(train_summary).exists() else None,
        "samples": samples(model, tokenizer),
        "files_bytes": {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file()},
        "note": note,
    }
    (model_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    out.write_text(render(metrics))
    return metrics


def render(m: dict) -> str:
    tr = m["training"] or {}
    cfg = tr.get("config", {})
    shape = "{num_layers} / {hidden_size} / {num_heads} ({num_kv_heads}) / {head_dim} / {intermediate_size}".format(
        **{k: cfg.get(k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                   "intermediate_size")})
    facts = [
        ("parameters", f"{m['params'] / 1e6:.2f} M (tied embeddings)"),
        ("layers / hidden / heads (kv) / head_dim / MLP", shape),
        ("vocabulary", "8192 (byte-level BPE, `tokenizer.json`; pad 0, bos 1, eos 2, mask 3)"),
        ("tokens seen", f"{tr.get('tokens_seen', 0) / 1e6:.1f} M ({tr.get('steps')} steps of "
                        f"{cfg.get('batch_size')} x {cfg.get('seq_len')})"),
        ("training time", f"{tr.get('train_minutes', 0):.0f} min on 2 CPU cores (shared with other work)"),
        ("final validation loss (full splits, training script)",
         ", ".join(f"{k} {v:.3f}" for k, v in (tr.get("val_loss") or {}).items())),
        ("weights", "bfloat16 safetensors"),
    ]
    fact_rows = "\n".join(f"| {k} | {v} |" for k, v in facts)
    rows = "\n".join(
        f"| {d} | {EVAL_SPLITS[d]} | {v['nll']:.3f} | {v['perplexity']:.2f} | {v['tokens']} |"
        for d, v in m["eval"].items()
    )
    sample_md = "\n\n".join(f"**{k}** (greedy, 96 new tokens):\n\n```\n{s}\n```" for k, s in m["samples"].items())
    files = "\n".join(f"| `target/{k}` | {v / 1e6:.2f} MB |" for k, v in m["files_bytes"].items())
    return f"""# Shipped demo models

Everything here is trained on this repository's offline corpus (`python -m dspark_kernels.train.corpus`: the Python
standard library's sources, its docstrings and pydoc topics; C headers held out), so the demo runs with no download.

## Target (`target/`): Qwen3 architecture, trained from scratch

| | |
| --- | --- |
{fact_rows}

Perplexity on the fixed evaluation set (the first {m['eval_set']['blocks']} blocks x {m['eval_set']['seq_len']} tokens
of each domain's split, harder text than the split's average; recomputed by `tests/test_shipped_target.py`):

| domain | split | NLL (nats/token) | perplexity | tokens |
| --- | --- | --- | --- | --- |
{rows}

{sample_md}

### Files

| file | size |
| --- | --- |
{files}

### Reproduce

```bash
python -m dspark_kernels.train.corpus --out data/corpus
python -m dspark_kernels.train.tokenizer --corpus data/corpus --out dspark_kernels/assets/target
python -m dspark_kernels.train.target --corpus data/corpus --work-dir data/target_run \\
    --out dspark_kernels/assets/target --max-steps {tr.get('steps', 2000)}
python -m dspark_kernels.train.model_card --model dspark_kernels/assets/target --corpus data/corpus
python -m dspark_kernels.train.rollouts --split train --num-prompts 1024
python -m dspark_kernels.train.rollouts --split heldout --num-prompts 2048
```
Training is seeded, but thread scheduling makes CPU float sums order-dependent, so a rerun matches closely rather than
bit for bit. {m.get("note", "")}

## Drafters (`drafters/`)

`dspark` (vanilla Markov head, rank 64, 2 layers over target layers 0/2/4, with `calibration.json` from STS),
`dspark_rnn` (RNN head), `dflash` (rank 0, CE only), `eagle` (one-layer chain drafter over target layer 4) and `mtp1`
(the same chain drafter trained for one token): all trained on the same 1024 target rollouts with the same budget
(1600 steps of 8 sequences: each was trained for 300 steps, resumed to 1000 and then to 1600, each time with its
cosine schedule recomputed over the longer run, warm restarts that were identical for all five; the last stage ran in
a scratch work directory and was copied here). Each directory holds `drafter_config.json`, `model.safetensors`
(bfloat16, without the target's frozen embedding and LM head) and `train_summary.json` with the exact arguments of the
last call; `scripts/build_demo_assets.sh` has the commands. Their acceptance is measured by
`python -m dspark_kernels.bench acceptance` (see the top README).

## Assistant (`assistant/`)

A 2-layer Qwen3 (hidden 128, GQA 2/1, MLP 384, tied embeddings, the target's tokenizer), trained like the target on the
same corpus for 600 steps (`python -m dspark_kernels.train.target --size assistant --max-steps 600`). It is not part
of DSpark: `python -m dspark_kernels.bench peers` hands it to `transformers`' assisted generation as the classic
"small draft model of the same family" baseline.
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("dspark_kernels/assets/target"),
                   help="trained target directory (metrics.json is written into it)")
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"),
                   help="corpus of its training")
    p.add_argument("--train-summary", type=Path, default=Path("data/target_run/summary.json"),
                   help="the target trainer's summary.json")
    p.add_argument("--out", type=Path, default=Path("dspark_kernels/assets/README.md"),
                   help="model card (markdown) to write")
    p.add_argument("--note", default="", help="free text appended to the card (e.g. how the shipped run differed)")
    args = p.parse_args(argv)
    metrics = write_card(args.model, args.corpus, args.train_summary, args.out, args.note)
    print(json.dumps({k: v for k, v in metrics.items() if k != "training"}, indent=1))


if __name__ == "__main__":
    main()
