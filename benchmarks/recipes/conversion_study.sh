#!/usr/bin/env bash
# The conversion study (experiments/conversion-generalization/) on a rented GPU of one's own: one H100 or H200, no
# time limit per command, `setup.sh` run, and fla-core 0.6.0 + tilelang 0.1.15 installed (pip, or
# tools/device/make_bundle.sh's wheels on a host without a registry). The study's driver runs the package's commands:
# one seed's lever comparison at 12.5M tokens (the study's first setting, each data lever alone, both = the package's
# defaults, and the 5:1 mask), each converted and scored on the unseen cells at 1K / 2K / 4K with the teacher beside
# (n = 100), then the study's tables with these rows beside its own. Measured on one H100 with the study's pieces:
# ~280 s of document sampling per conversion, ~250 s of training and ~250 s of scoring per arm.
# Usage: bash benchmarks/recipes/conversion_study.sh [OUT_DIR] [SEED]   (from the repository root; default runs/gen, 5)
# Stored results: experiments/conversion-generalization/ (retention.csv with source = cli; records/ after `keep`)
set -euo pipefail
OUT=${1:-runs/gen}
SEED=${2:-5}
D="python experiments/conversion-generalization/run.py --out $OUT --seed $SEED"
for lever in baseline s2 s3 both; do
  $D convert --lever "$lever"
  $D eval --lever "$lever"
done
$D convert --arm hydra-5to1 --lever baseline
$D eval --arm hydra-5to1 --lever baseline
$D generate                                       # the default recipe's student answers a short retrieval prompt
$D tables                                         # OUT/tables/: the study's tables, this run's rows as source = cli
# to keep them: $D keep && $D tables --write-to experiments/conversion-generalization (then commit)
