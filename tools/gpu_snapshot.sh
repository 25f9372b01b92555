#!/usr/bin/env bash
# Pack the committed tree (HEAD) for a GPU run that must not see uncommitted edits in the working tree:
#   bash tools/gpu_snapshot.sh            -> .snap/tree.tar and .snap/commit  (.snap/ is git-ignored)
# On the GPU machine:
#   mkdir -p /tmp/w && tar -xf .snap/tree.tar -C /tmp/w && cd /tmp/w && export FDLIB_GIT_COMMIT=$(cat <repo>/.snap/commit)
# so that every result's provenance names the exact commit that ran (fdlib.bench.harness._git).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .snap
git archive --format=tar -o .snap/tree.tar HEAD
git rev-parse HEAD > .snap/commit
echo "packed $(cat .snap/commit) into .snap/tree.tar ($(du -h .snap/tree.tar | cut -f1))"
