"""Offline training pipeline: corpus, tokenizer, target model, rollouts (and, later, the drafter)."""
