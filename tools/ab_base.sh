#!/usr/bin/env bash
# The base of a kernel A/B: the tree at a revision (default HEAD, i.e. without
# the working tree's changes) into ab_base/, which the device call carries and
# `tools/gpu_check.sh ab` installs beside this build (tools/ab_kernels.py).
#
#   tools/ab_base.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
rm -rf ab_base
mkdir ab_base
git archive "$rev" | tar -x -C ab_base
echo "ab_base/ = $(git rev-parse --short "$rev")" | tee ab_base/.revision
