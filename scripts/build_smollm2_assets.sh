#!/usr/bin/env bash
# Rebuild the drafters shipped for SmolLM2-135M-Instruct from scratch on a CPU machine (no network after the model's
# fetch): chat prompt sets, the target's own answers with their features recorded, the four drafters (DSpark, DFlash,
# EAGLE-style chain, MTP-1) and the transformers assistant on the first N_TRAIN rollouts, then DSpark and MTP-1
# further on N_MORE, the token ranking of the draft vocabulary, calibration, and the acceptance benchmark. Every step
# resumes where it stopped (run the script again). Knobs: N_TRAIN (train prompts answered first), N_MORE (all train
# prompts answered for the last stage), STEPS (optimiser steps of DSpark and DFlash over the whole vocabulary),
# FT_STEPS (DSpark's further steps over the 8192-token draft vocabulary), MTP1_STEPS (MTP-1's, over the draft
# vocabulary, with input norms; STEPS + FT_STEPS by default, DSpark's total), EAGLE_STEPS (of the EAGLE-style chain,
# whose unroll of 4 steps costs about 4x a step of the others, and of the assistant), MORE_STEPS (DSpark's and MTP-1's
# stage on the N_MORE rollouts), N_ALL and ALL_STEPS (the train prompts answered for the last stage, and DSpark's and
# MTP-1's steps on them), THREADS (per trainer; the trainers run side by side).
set -euo pipefail
cd "$(dirname "$0")/.."
N_TRAIN=${N_TRAIN:-576}
N_MORE=${N_MORE:-1152}
STEPS=${STEPS:-450}
FT_STEPS=${FT_STEPS:-1150}
MTP1_STEPS=${MTP1_STEPS:-$((STEPS + FT_STEPS))}
EAGLE_STEPS=${EAGLE_STEPS:-200}
MORE_STEPS=${MORE_STEPS:-1500}
N_ALL=${N_ALL:-2304}
ALL_STEPS=${ALL_STEPS:-1500}
THREADS=${THREADS:-1}
MODEL=smollm2-135m-instruct
OUT=dspark_kernels/assets/drafters/$MODEL
RO=data/rollouts_smollm2
LAYERS="2 15 28"  # block drafters' feature layers, spread over the target's 30; EAGLE/MTP-1 read layer 28

python -m dspark_kernels.assets fetch $MODEL
python -m dspark_kernels.train.prompts --out data/prompts
python -m dspark_kernels.train.rollouts --model $MODEL --prompts data/prompts --split heldout --num-prompts 150 \
    --max-new-tokens 512 --temperatures 0 1 --batch-size 50 --shard-size 150 --feature-layers $LAYERS --out $RO \
    --resume
python -m dspark_kernels.train.rollouts --model $MODEL --prompts data/prompts --split train --num-prompts "$N_TRAIN" \
    --max-new-tokens 512 --temperatures 0 1 --batch-size 64 --shard-size 192 --feature-layers $LAYERS --out $RO \
    --resume

common=(--target $MODEL --rollouts $RO --steps "$STEPS" --batch-size 8 --resume)
block=(--feature-layers $LAYERS --layers 2 --gammas 7 15 --anchors 8)
run() {  # name, trainer module, args...: one trainer in the background with its own log
    local name=$1 module=$2; shift 2
    OMP_NUM_THREADS=$THREADS python -m "dspark_kernels.train.$module" --name "$name" --out "$OUT/$name" \
        --work-dir "data/drafter_runs/$MODEL/$name" "${common[@]}" "$@" > "data/logs/train_$name.log" 2>&1 &
}
mkdir -p data/logs
run dspark drafter "${block[@]}" --head vanilla --rank 64
run dflash drafter "${block[@]}" --loss dflash --rank 0
wait
python -m dspark_kernels.train.token_ranking --rollouts $RO --out $OUT/dspark $OUT/dflash
# DSpark trains on over the draft vocabulary it drafts with (seed 1: other batches than its first steps'); MTP-1
# trains over it from the start, reading its feature and token embedding through input norms
common=(--target $MODEL --rollouts $RO --steps "$FT_STEPS" --batch-size 8 --resume --draft-vocab 8192
        --token-ranking $OUT/dspark)
OMP_NUM_THREADS=$THREADS python -m dspark_kernels.train.drafter --name dspark --out $OUT/dspark \
    --work-dir data/drafter_runs/$MODEL/dspark-ft "${common[@]}" "${block[@]}" --head vanilla --rank 64 \
    --init $OUT/dspark --seed 1 > data/logs/train_dspark-ft.log 2>&1 &
common=(--target $MODEL --rollouts $RO --steps "$MTP1_STEPS" --batch-size 8 --resume --draft-vocab 8192
        --token-ranking $OUT/dspark)
run mtp1 chain_drafter --feature-layer 28 --positions 64 --input-norm
wait
common=(--target $MODEL --rollouts $RO --steps "$EAGLE_STEPS" --batch-size 8 --resume)
run eagle chain_drafter --feature-layer 28 --positions 16
OMP_NUM_THREADS=$THREADS python -m dspark_kernels.train.assistant --target $MODEL --rollouts $RO --steps "$EAGLE_STEPS" \
    --batch-size 8 --positions 64 --out data/assistant_smollm2 --work-dir data/drafter_runs/$MODEL/assistant --resume \
    > data/logs/train_assistant.log 2>&1
wait
python -m dspark_kernels.train.token_ranking --rollouts $RO --out $OUT/eagle  # MTP-1's trainer copied its ranking

# twice the train rollouts (--resume answers prompts N_TRAIN.. only), then DSpark (16 anchors a rollout) and MTP-1
# train on over all of them from the weights above, side by side
python -m dspark_kernels.train.rollouts --model $MODEL --prompts data/prompts --split train --num-prompts "$N_MORE" \
    --max-new-tokens 512 --temperatures 0 1 --batch-size 64 --shard-size 192 --feature-layers $LAYERS --out $RO \
    --resume
common=(--target $MODEL --rollouts $RO --steps "$MORE_STEPS" --batch-size 8 --resume --draft-vocab 8192
        --token-ranking $OUT/dspark --seed 3)
OMP_NUM_THREADS=$THREADS python -m dspark_kernels.train.drafter --name dspark --out $OUT/dspark \
    --work-dir data/drafter_runs/$MODEL/dspark-more "${common[@]}" "${block[@]}" --anchors 16 --head vanilla \
    --rank 64 --init $OUT/dspark > data/logs/train_dspark-more.log 2>&1 &
OMP_NUM_THREADS=$THREADS python -m dspark_kernels.train.chain_drafter --name mtp1 --out $OUT/mtp1 \
    --work-dir data/drafter_runs/$MODEL/mtp1-more "${common[@]}" --feature-layer 28 --positions 64 --input-norm \
    --init $OUT/mtp1 > data/logs/train_mtp1-more.log 2>&1 &
wait

# twice again (prompts N_MORE..N_ALL), then DSpark and MTP-1 once more over all of them, one after the other
python -m dspark_kernels.train.rollouts --model $MODEL --prompts data/prompts --split train --num-prompts "$N_ALL" \
    --max-new-tokens 512 --temperatures 0 1 --batch-size 64 --shard-size 192 --feature-layers $LAYERS --out $RO \
    --resume
common=(--target $MODEL --rollouts $RO --steps "$ALL_STEPS" --batch-size 8 --resume --draft-vocab 8192
        --token-ranking $OUT/dspark --seed 5)
python -m dspark_kernels.train.drafter --name dspark --out $OUT/dspark --work-dir data/drafter_runs/$MODEL/dspark-all \
    "${common[@]}" "${block[@]}" --anchors 16 --head vanilla --rank 64 --init $OUT/dspark \
    > data/logs/train_dspark-all.log 2>&1
python -m dspark_kernels.train.chain_drafter --name mtp1 --out $OUT/mtp1 --work-dir data/drafter_runs/$MODEL/mtp1-all \
    "${common[@]}" --feature-layer 28 --positions 64 --input-norm --init $OUT/mtp1 > data/logs/train_mtp1-all.log 2>&1

python -m dspark_kernels.train.calibration --model $MODEL --drafter $OUT/dspark --rollouts $RO --num-prompts 96 \
    --max-new-tokens 64
python -m dspark_kernels.bench acceptance --model $MODEL --prompts data/prompts --num-prompts 6 \
    --max-new-tokens 64 --json results/acceptance_smollm2.json
