# Sourced by the tools/gpu_*.sh calls: what every call records first, and the stages several of them run.
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
# kernel_grid_cases: the 24 batches of results/h100/kernel-grid/ (B 8/32/128, 32:8 and 32:32, constant, uniform and
# Zipf-like lengths of mean 1024-32768, contiguous and pages of 16), as tools/ab_ragged.py's --cases.
kernel_grid_cases() {
  local cases="" page c
  for page in 0 16; do
    for c in 8:32:8:constant:1024 8:32:8:uniform:8192 8:32:8:zipf:32768 32:32:8:constant:8192 32:32:8:uniform:1024 \
             32:32:8:zipf:8192 32:32:8:uniform:32768 128:32:8:constant:1024 128:32:8:zipf:1024 128:32:8:uniform:8192 \
             32:32:32:zipf:1024 32:32:32:constant:8192; do
      cases="$cases${cases:+,}$c:$page"
    done
  done
  echo "$cases"
}
# sanitize NAME SECONDS PREFIX [TOOL...]: compute-sanitizer with each TOOL (default memcheck and racecheck) on
# tools/sanitize_NAME.py, at most SECONDS each, its output and exit status in $R/PREFIX-TOOL.txt; then pack. Nothing
# where compute-sanitizer is missing.
sanitize() {
  local name=$1 secs=$2 prefix=$3 tool; shift 3
  local tools=("$@"); [[ ${#tools[@]} -eq 0 ]] && tools=(memcheck racecheck)
  command -v compute-sanitizer >/dev/null || return 0
  for tool in "${tools[@]}"; do
    timeout "$secs" compute-sanitizer --tool "$tool" python "tools/sanitize_$name.py" > "$R/$prefix-$tool.txt" 2>&1
    echo "rc=$?" >> "$R/$prefix-$tool.txt"; tail -2 "$R/$prefix-$tool.txt"
  done; pack
}
# invariant_at VAR TAG VALUE...: batch_invariant=True timed at each VALUE of the environment variable VAR (an fdlib
# setting read at import): the serving batches (python -m fdlib.bench --serving --methods invariant: the host plan,
# the default call, the captured graph and the invariant plan), files $R/serving-TAG<VALUE>.*, packed after each.
invariant_at() {
  local var=$1 tag=$2 v; shift 2
  for v in "$@"; do
    env "$var=$v" timeout 130 python -m fdlib.bench --serving --methods invariant --warmup 10 --rep 30 \
      --graph-rep 10 --budget-s 110 --out "$R" --name "serving-$tag$v" > "$R/serving-$tag$v.log" 2> "$R/serving-$tag$v.err"
    echo "bench rc=$?" >> "$R/serving-$tag$v.log"; grep -E "^\| [0-9]" "$R/serving-$tag$v.log" | head -14 | cut -c1-40,130-
    pack
  done
}
# dense_invariant_at VAR TAG BS LS VALUE...: the dense grid of B in BS and L in LS (comma lists), 32:8, D=128, bf16,
# auto against invariant, at each VALUE of VAR: files $R/dense-TAG<VALUE>.*, packed after each.
dense_invariant_at() {
  local var=$1 tag=$2 bs=$3 ls=$4 v; shift 4
  for v in "$@"; do
    env "$var=$v" timeout 40 python -m fdlib.bench --dtype bfloat16 --methods auto,invariant --B "$bs" --L "$ls" \
      --heads 32:8 --D 128 --warmup 10 --rep 30 --graph-rep 10 --no-plot --no-progress --out "$R" \
      --name "dense-$tag$v" > "$R/dense-$tag$v.log" 2>&1
    sed -n '/time \/ cuDNN\|Effective bandwidth/,/Relative/p' "$R/dense-$tag$v.log" | head -12; pack
  done
}
