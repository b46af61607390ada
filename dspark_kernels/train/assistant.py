"""Train a small same-tokenizer assistant of a target on its rollouts, for ``transformers``' assisted generation.

The peer benchmark's ``hf_assisted`` baseline needs a small model that shares the target's tokenizer. This trainer
builds one from the target itself: the target's architecture (a ``transformers`` model of the same ``model_type``)
with ``--layers`` decoder layers, initialised from target layers spread over its depth (the first and the last for
two), the target's final norm, and the target's embedding and tied LM head, which stay frozen. It is trained like
MTP-1 (:mod:`.chain_drafter`, same loss and budget): at ``--positions`` random response positions of each rollout,
``0.1 * CE`` against the rollout's next token plus ``0.9 * L1`` (twice the TV distance) to the target's
temperature-1 distribution there (recorded with the rollouts, or one target forward). The saved directory
(``config.json``, ``model.safetensors`` in bf16, ``train_summary.json``) loads with
``AutoModelForCausalLM.from_pretrained``.

CLI::

    python -m dspark_kernels.train.assistant --target smollm2-135m-instruct --rollouts data/rollouts_smollm2 \\
        --out data/assistant_smollm2 --steps 450
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cli_args import positive_int
from ..models import load_model
from ..models.convert import converted_directory
from .drafter_data import rollout_outputs, target_logits
from .loop import add_optimiser_arguments, add_training_arguments, check_batch_size, run_training, training_main
from .rollouts import load_rollout_dirs

__all__ = ["Assistant", "assistant_loss"]


class Assistant(nn.Module):
    """A ``transformers`` causal LM cut from a target (see the module docstring), with the trainer's ``save``."""

    def __init__(self, target_dir: Path, layers: int) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        full_cfg = AutoConfig.from_pretrained(target_dir)
        if not 1 <= layers <= full_cfg.num_hidden_layers:
            raise ValueError(f"--layers must be in 1..{full_cfg.num_hidden_layers} (the target's layers), got {layers}")
        full = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        cfg = AutoConfig.from_pretrained(target_dir)
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
        self.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        n = full_cfg.num_hidden_layers
        self.source_layers = [round(i * (n - 1) / max(layers - 1, 1)) for i in range(layers)]
        own = self.model.state_dict()
        for name, value in full.state_dict().items():
            if ".layers." in name:
                prefix, rest = name.split(".layers.", 1)
                idx, tail = rest.split(".", 1)
                if int(idx) in self.source_layers:
                    own[f"{prefix}.layers.{self.source_layers.index(int(idx))}.{tail}"] = value
            elif name in own:
                own[name] = value
        self.model.load_state_dict(own)
        self.model.tie_weights()
        self.model.get_input_embeddings().weight.requires_grad_(False)  # the target's, frozen (tied or not)
        self.model.get_output_embeddings().weight.requires_grad_(False)

    def hidden(self, tokens: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Last hidden states ``[B, L, hidden]`` (after the final norm) of right-padded ``tokens [B, L]``."""
        mask = (torch.arange(tokens.shape[1])[None, :] < lens[:, None]).long()
        return self.model.model(input_ids=tokens, attention_mask=mask).last_hidden_state

    def save(self, out_dir: str | Path) -> None:
        self.model.save_pretrained(out_dir, safe_serialization=True)


def assistant_loss(assistant: Assistant, batch, target, positions: int, weights: tuple[float, float] = (0.1, 0.9),
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """The MTP-1-style loss (module docstring) at up to ``positions`` random response positions per sequence; position
    ``t`` predicts token ``t + 1``."""
    a_ce, a_tv = weights
    b, seq_len = batch.tokens.shape
    t = torch.arange(seq_len).expand(b, seq_len)
    ok = (t + 1 >= batch.prompt_lens[:, None]) & (t + 1 < batch.lens[:, None])  # next token is a response token
    score = torch.rand(b, seq_len, generator=generator) + ok.float()
    t = score.topk(min(positions, seq_len), dim=1).indices.sort(dim=1).values  # [B, P]
    valid = ok.gather(1, t)
    h = assistant.hidden(batch.tokens, batch.lens)
    h = h.gather(1, t[..., None].expand(-1, -1, h.shape[-1]))
    log_pd = F.log_softmax(assistant.model.lm_head(h).float(), dim=-1)
    labels = batch.tokens.gather(1, (t + 1).clamp(max=seq_len - 1))
    rows = batch.last_hidden.gather(1, t[..., None].expand(-1, -1, batch.last_hidden.shape[-1]))
    tgt = F.softmax(target_logits(target, rows), dim=-1)
    ce = -log_pd.gather(-1, labels[..., None]).squeeze(-1)
    l1 = (log_pd.exp() - tgt).abs().sum(-1)
    n = valid.sum().clamp_min(1)
    ce_mean, l1_mean = (ce * valid).sum() / n, (l1 * valid).sum() / n
    return a_ce * ce_mean + a_tv * l1_mean, {"ce": ce_mean.item(), "l1": l1_mean.item()}


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = load_model(args.target)
    rollouts = load_rollout_dirs(args.rollouts, "train", features=True)
    check_batch_size(args.batch_size, len(rollouts), args.rollouts)
    try:
        assistant = Assistant(converted_directory(args.target), args.layers)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    order = list(range(len(rollouts)))
    last_layer = (target.config.num_hidden_layers - 2,)  # any recorded layer: only the last hidden state is read

    def loss_fn():
        layers = rollouts.feature_layers[-1:] if rollouts.feature_layers else last_layer
        batch = rollout_outputs(target, rollouts, rng.sample(order, args.batch_size), layers)
        return assistant_loss(assistant, batch, target, args.positions)

    summary = run_training(assistant, args, rng, loss_fn)
    summary["source_layers"] = assistant.source_layers
    (Path(args.out) / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", default="assistant", help="run name (logs and the summary)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers of the assistant")
    p.add_argument("--positions", type=positive_int, default=64,
                   help="supervised positions sampled per sequence and step (bounds the logits' memory)")
    add_training_arguments(p)
    add_optimiser_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    training_main(build_parser(), train, argv)


if __name__ == "__main__":
    main()
