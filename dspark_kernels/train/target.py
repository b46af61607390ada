"""Train the shipped demo target (Qwen3 architecture) from scratch on the offline corpus, resumably.

The model is a ``transformers.Qwen3ForCausalLM`` so that the saved directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``generation_config.json``) loads both in ``transformers`` and in our runtime
(``dspark_kernels.models.load_model``).

Data: every training-split document of the training domains, wrapped as ``<|bos|> text <|eos|>``, concatenated and cut
into ``seq_len`` blocks; batches are drawn by a seeded permutation per epoch. Optimiser: AdamW, linear warmup then
cosine decay to ``min_lr_ratio``; gradient clipping 1.0. A checkpoint (model, optimiser, step, data order) is written
every ``--ckpt-every`` steps to ``--work-dir``; ``--resume`` continues from it. Losses go to ``work_dir/log.jsonl``.

CLI::

    python -m dspark_kernels.train.target --corpus data/corpus --work-dir data/target_run \
        --out dspark_kernels/assets/target --max-minutes 100
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .corpus import read_split
from .tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, TRAIN_DOMAINS, load_tokenizer


@dataclass
class TargetTrainConfig:
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    max_steps: int = 1500
    weight_decay: float = 0.1
    seed: int = 0
    rope_theta: float = 10000.0


# Model sizes the trainer knows. "assistant" is the small same-tokenizer model that the peer benchmark hands to
# transformers' assisted generation (the classic "small draft model of the same family" baseline).
SIZES = {
    "target": {},
    "assistant": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 384},
}


def make_hf_config(cfg: TargetTrainConfig, vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=4096,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """``<|bos|> doc <|eos|>`` for every document, concatenated: int64 ``[n_tokens]``."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int64)


def blocks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def lr_at(step: int, cfg: TargetTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, batch_size: int = 16, max_blocks: int | None = None) -> float:
    """Mean next-token cross-entropy (nats/token) over the blocks of ``data``."""
    model.eval()
    if max_blocks is not None:
        data = data[:max_blocks]
    total, count = 0.0, 0
    for i in range(0, data.shape[0], batch_size):
        x = data[i : i + batch_size]
        logits = model(input_ids=x).logits[:, :-1].float()
        flat = logits.reshape(-1, logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(flat, x[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def save_target(model, tokenizer, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the Hugging Face directory: weights in ``dtype``, config, tokenizer, generation defaults."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=True, temperature=0.7, top_p=0.95
    ).save_pretrained(out_dir)
    (out_dir / "special_tokens.json").write_text(
        json.dumps({"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "mask": MASK_ID}, indent=1) + "\n"
    )


def train(args: argparse.Namespace) -> None:
    from tqdm import tqdm
    from transformers import Qwen3ForCausalLM

    cfg = TargetTrainConfig(max_steps=args.max_steps, seed=args.seed, **SIZES[args.size])
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(args.tokenizer)
    train_texts = [t for d in TRAIN_DOMAINS for t in read_split(args.corpus, d, "train")]
    train_data = blocks(token_stream(tokenizer, train_texts), cfg.seq_len)
    val = {d: blocks(token_stream(tokenizer, read_split(args.corpus, d, "validation")), cfg.seq_len)
           for d in TRAIN_DOMAINS}
    model = Qwen3ForCausalLM(make_hf_config(cfg, tokenizer.get_vocab_size()))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "checkpoint.pt"
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, tokens_seen, elapsed_before = ckpt["step"], ckpt["tokens_seen"], ckpt["elapsed_s"]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, train blocks {train_data.shape[0]} x {cfg.seq_len}, resume at step {step}")
    log = open(work / "log.jsonl", "a")
    start = time.time()
    bar = tqdm(total=cfg.max_steps, initial=step, desc=args.size, dynamic_ncols=True)
    model.train()
    per_epoch = train_data.shape[0] // cfg.batch_size

    def checkpoint():
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens_seen": tokens_seen,
             "elapsed_s": elapsed_before + time.time() - start, "config": asdict(cfg)},
            ckpt_path,
        )

    while step < cfg.max_steps and (time.time() - start) / 60 < args.max_minutes:
        epoch, pos = divmod(step, per_epoch)
        order = torch.randperm(train_data.shape[0], generator=torch.Generator().manual_seed(cfg.seed + epoch))
        x = train_data[order[pos * cfg.batch_size : (pos + 1) * cfg.batch_size]]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_at(step, cfg):.2e}")
        record = {"step": step, "loss": loss.item(), "tokens": tokens_seen}
        if step % args.eval_every == 0:
            record.update({f"val_{d}": eval_loss(model, v, max_blocks=64) for d, v in val.items()})
            bar.write(json.dumps(record))
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step % args.ckpt_every == 0:
            checkpoint()
    bar.close()
    checkpoint()
    elapsed = elapsed_before + time.time() - start
    final = {d: eval_loss(model, v) for d, v in val.items()}
    summary = {"params": n_params, "steps": step, "tokens_seen": tokens_seen, "train_minutes": elapsed / 60,
               "val_loss": final, "config": asdict(cfg)}
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    save_target(model, tokenizer, Path(args.out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"),
                   help="training corpus")
    p.add_argument("--tokenizer", type=Path, default=Path("dspark_kernels/assets/target/tokenizer.json"),
                   help="tokenizer.json of the target")
    p.add_argument("--work-dir", type=Path, default=Path("data/target_run"),
                   help="checkpoints and logs")
    p.add_argument("--out", type=Path, default=Path("dspark_kernels/assets/target"),
                   help="directory the trained model is saved to")
    p.add_argument("--size", choices=sorted(SIZES), default="target",
                   help="model size preset (assistant: 2 layers, hidden 128, for the peer benchmark)")
    p.add_argument("--max-steps", type=int, default=1500,
                   help="optimiser steps")
    p.add_argument("--max-minutes", type=float, default=110.0,
                   help="stop (and save) after this many minutes")
    p.add_argument("--eval-every", type=int, default=250,
                   help="steps between validation evaluations")
    p.add_argument("--ckpt-every", type=int, default=100,
                   help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initialisation and batches")
    p.add_argument("--resume", action="store_true",
                   help="continue from the work directory's checkpoint")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    train(args)


if __name__ == "__main__":
    main()
