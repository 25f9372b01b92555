# Sourced by the tools/gpu_*_run.sh calls: what every call records first.
# provenance FILE: the GPU, its memory and driver, torch/triton/transformers versions and the UTC date, into FILE.
provenance() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
    date -u; } 2>&1 | tee "$1"
}
# start_run OUT NAME: the stage folder R=OUT/NAME with its provenance; pack() then packs it into OUT/NAME.tgz (at most
# 8 files come back from $OUT: one archive, rewritten after each stage, keeps what finished if the lease ends).
start_run() {
  PACK_OUT=$1; PACK_NAME=$2; R="$1/$2"; mkdir -p "$R"; provenance "$R/gpu.txt"
}
pack() {
  tar czf "$PACK_OUT/$PACK_NAME.tgz.tmp" -C "$PACK_OUT" "$PACK_NAME" && mv "$PACK_OUT/$PACK_NAME.tgz.tmp" "$PACK_OUT/$PACK_NAME.tgz"
}
