# Sourced by the tools/gpu_*_run.sh calls: what every call records first.
# provenance FILE: the GPU, its memory and driver, torch/triton/transformers versions and the UTC date, into FILE.
provenance() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
    date -u; } 2>&1 | tee "$1"
}
