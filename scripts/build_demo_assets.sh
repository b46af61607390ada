#!/usr/bin/env bash
# Rebuild every shipped demo asset from scratch on a CPU machine (no network): corpus, tokenizer, target, model card,
# rollouts, the five drafters, calibration, and the acceptance benchmark. Each step is resumable on its own; the
# commands are the ones the model card quotes. Set STEPS_TARGET / STEPS_DRAFTER_STAGES / N_ROLLOUTS to trade time for
# quality.
# The shipped drafters were trained for 300 steps, then resumed to 1000 and to 1600 with the cosine schedule recomputed
# over the longer run each time (warm restarts); STEPS_DRAFTER_STAGES lists the stages, the same for every drafter.
# Then each was fine-tuned for STEPS_FINETUNE steps (learning rate 3e-4, seed 1) on the sampled rollouts pooled with
# greedy ones (the demo decodes greedily, and greedy continuations loop where sampled ones rarely do), the block
# drafters on block widths 1 2 3 7 15 (narrow drafts are what a confidence-scheduled engine runs at low load).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS_TARGET=${STEPS_TARGET:-1400}
STEPS_DRAFTER_STAGES=${STEPS_DRAFTER_STAGES:-"300 1000 1600"}
STEPS_FINETUNE=${STEPS_FINETUNE:-600}
N_ROLLOUTS=${N_ROLLOUTS:-1024}
A=dspark_kernels/assets

python -m dspark_kernels.train.corpus --out data/corpus
python -m dspark_kernels.train.tokenizer --corpus data/corpus --out $A/target
python -m dspark_kernels.train.target --corpus data/corpus --work-dir data/target_run --out $A/target \
    --max-steps "$STEPS_TARGET" --resume
python -m dspark_kernels.train.model_card --model $A/target --corpus data/corpus
python -m dspark_kernels.train.rollouts --model $A/target --split train --num-prompts "$N_ROLLOUTS"
python -m dspark_kernels.train.rollouts --model $A/target --split heldout --num-prompts 2048
python -m dspark_kernels.train.rollouts --model $A/target --split train --num-prompts "$N_ROLLOUTS" --temperatures 0 \
    --seed 100 --out data/rollouts_greedy
# the small same-tokenizer model that `bench peers` gives transformers' assisted generation
python -m dspark_kernels.train.target --size assistant --corpus data/corpus --work-dir data/assistant_run \
    --out $A/assistant --max-steps 600 --eval-every 200 --resume

train_block() {  # name, extra args
    local name=$1; shift
    for steps in $STEPS_DRAFTER_STAGES; do
        python -m dspark_kernels.train.drafter --name "$name" --steps "$steps" --out $A/drafters/"$name" --resume "$@"
    done
}
train_chain() {
    local name=$1; shift
    for steps in $STEPS_DRAFTER_STAGES; do
        python -m dspark_kernels.train.chain_drafter --name "$name" --steps "$steps" --out $A/drafters/"$name" \
            --resume "$@"
    done
}
train_block dspark --head vanilla --rank 64
train_block dflash --loss dflash --rank 0
train_block dspark_rnn --head rnn --rank 64
train_chain eagle
train_chain mtp1
finetune=(--steps "$STEPS_FINETUNE" --lr 3e-4 --seed 1 --rollouts data/rollouts data/rollouts_greedy)
finetune_block() {  # name, architecture args (as for train_block)
    local name=$1; shift
    python -m dspark_kernels.train.drafter --name "$name" "$@" --gammas 1 2 3 7 15 "${finetune[@]}" \
        --init $A/drafters/"$name" --work-dir data/drafter_runs/"$name"_greedy --out $A/drafters/"$name"
}
finetune_block dspark --head vanilla --rank 64
finetune_block dflash --loss dflash --rank 0
finetune_block dspark_rnn --head rnn --rank 64
for name in mtp1 eagle; do
    python -m dspark_kernels.train.chain_drafter --name "$name" "${finetune[@]}" --init $A/drafters/"$name" \
        --work-dir data/drafter_runs/"$name"_greedy --out $A/drafters/"$name"
done
for d in dspark dspark_rnn; do
    python -m dspark_kernels.train.calibration --model $A/target --drafter $A/drafters/$d --rollouts data/rollouts \
        --num-prompts 2048
done
python -m dspark_kernels.bench acceptance --json results/acceptance.json
