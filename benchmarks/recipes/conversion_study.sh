#!/usr/bin/env bash
# The conversion study (experiments/conversion-generalization/) on a rented GPU of one's own: one H100 or H200, no
# time limit per command, the repository cloned with its history (git), `setup.sh` run, and fla-core 0.6.0 +
# tilelang 0.1.15 installed (pip, or tools/device/make_bundle.sh's wheels on a host without a registry).
# One seed's five arms of the lever comparison (baseline hydra-7to1, stage-2 mix, stage-3 wordings, both, 5:1) at
# 12.5M tokens on the same documents, each scored on the unseen cells up to 4K, then the tables with the committed
# results. Measured on one H100 (session 10, seed 4): documents ~280 s, each arm ~250 s training + ~250 s scoring.
# Usage: bash benchmarks/recipes/conversion_study.sh [OUT_DIR] [SEED]   (from the repository root; default runs/gen, 5)
# Stored results: experiments/conversion-generalization/ (retention.csv, levers.md, levers_paired.csv, comparison.md;
#   copy OUT_DIR's new cells in with the records: records/cells.jsonl.gz)
set -euo pipefail
OUT=${1:-runs/gen}
SEED=${2:-5}
R="python experiments/conversion-generalization/run.py --out $OUT --model smollm2-135m --device cuda --budget-s 100000"
E="--eval-formats unseen --eval-max-len 4096 --eval-tasks-first niah_single"
# the committed cells' haystack (1,024 teacher samples; out of the tree since, in git's history), so that the new
# cells are scored on the same prompts as every committed arm and the teacher
mkdir -p "$OUT/suite"
[ -f "$OUT/suite/docs.pt" ] || git show e91faf4:experiments/conversion-generalization/state/suite/docs.pt > "$OUT/suite/docs.pt"
$R --piece report                                   # restores the committed records into OUT (the teacher's cells too)
$R --piece suite --eval-max-len 4096                # the prompt sets up to 4K
$R --piece data --seed "$SEED" --s2-retrieval 0.25 --s3-wordings 6   # the seed's documents, the study's and the levers' rows
for lever in "" "--s2-retrieval 0.25" "--s3-wordings 6" "--s2-retrieval 0.25 --s3-wordings 6"; do
  # shellcheck disable=SC2086
  $R --piece train --arm hydra-7to1 --seed "$SEED" --tokens 12.5M $lever
  # shellcheck disable=SC2086
  $R --piece eval --arm hydra-7to1 --seed "$SEED" --tokens 12.5M $lever $E
done
$R --piece train --arm hydra-5to1 --seed "$SEED" --tokens 12.5M
# shellcheck disable=SC2086
$R --piece eval --arm hydra-5to1 --seed "$SEED" --tokens 12.5M $E
$R --piece report                                   # OUT/retention*.csv, levers.md, levers_paired.csv, comparison.md
