#!/usr/bin/env bash
# One pass of every lesson on a machine with one GPU, in <= 8 minutes. Prints a markdown report (commit it as
# benchmarks/gpu_results.md). Usage, from the repository root:
#
#     bash benchmarks/gpu_check.sh                 # needs a CUDA GPU; NCCL worlds of one process
#     GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh   # dry run of the script itself on a CPU machine
#
# What it runs (each bounded by `timeout`, failures reported, never fatal):
#   1. every lessons/NN_*.py as ONE process with --device cuda (plain `python`, no process group);
#   2. every lesson under `torchrun --nproc_per_node=1` with --device cuda: NCCL with a world of one;
#   3. the GPU-only paths: fp16 autocast with GradScaler, peak CUDA memory with and without activation
#      checkpointing, PyTorch's own nn.SyncBatchNorm at world size 1 (see EXTRA below).
# Lessons that need several GPUs for NCCL (one GPU per rank) cannot run their multi-rank paths on one GPU.
set -u
cd "$(dirname "$0")/.."
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR/runs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
PER_RUN_S=${GPU_CHECK_TIMEOUT_S:-150}

# Extra runs: "name|launcher|script|args" (launcher: python, torchrun = 1 process, torchrun-restart = 1 process
# with --max-restarts=1). Lesson 08 itself runs the fp16 + GradScaler path on whatever device it is given; the
# benchmark adds peak CUDA memory per setting (fp32, accumulation, bf16, fp16 + GradScaler, checkpointing).
EXTRA=(
  "01 resume reproduces the uninterrupted run|python|lessons/01_single_gpu.py|--check-resume"
  "03 DDP equals one process (NCCL world of one)|torchrun|lessons/03_ddp.py|--check-equivalence"
  "03 through mp.spawn|python|lessons/03_ddp.py|--spawn 1 --check-equivalence"
  "06 nn.SyncBatchNorm (PyTorch's), world of one|torchrun|lessons/06_sync_batchnorm.py|--sync-impl torch"
  "14 FSDP2 on a GPU: CPUOffloadPolicy runs, fp16 params (NCCL world of one)|torchrun|lessons/14_fsdp2_in_practice.py|--param-dtype fp16"
  "16 crash and restart (NCCL world of one)|torchrun-restart|lessons/16_fault_tolerance.py|--crash-at-step 7 --crash-rank 0"
  "peak CUDA memory per setting|python|benchmarks/memory_speed.py|--repeats 3"
  "peak CUDA memory where activations dominate|python|benchmarks/memory_speed.py|--repeats 3 --batch 16384 --width 1024"
)

run_one() {  # name, launcher (python|torchrun), script path, args...
  local name=$1 launcher=$2 script=$3; shift 3
  local tag log json cmd
  tag=$(echo "$name" | tr -c 'A-Za-z0-9_.-' '_')
  log="$OUT_DIR/runs/$tag.log"; json="$OUT_DIR/runs/$tag.json"
  if [ "$launcher" = torchrun ]; then
    cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1 "$script")
  elif [ "$launcher" = torchrun-restart ]; then
    cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1 --max-restarts=1 "$script")
  else
    cmd=("$PY" "$script")
  fi
  local t0=$SECONDS
  timeout -k 5 "$PER_RUN_S" "${cmd[@]}" --device "$DEVICE" "$@" --results "$json" >"$log" 2>&1
  local rc=$?
  echo "$name|$launcher|$script|$*|$rc|$((SECONDS - t0))" >>"$OUT_DIR/runs/index.txt"
}
export -f run_one
export OUT_DIR PY DEVICE PER_RUN_S

echo "# GPU check"
echo
echo '```'
date -u +"%Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| available', torch.cuda.is_available(), '| nccl', torch.distributed.is_nccl_available())"
"$PY" -c "import torch.distributed.constants as c; print('default collective timeout: gloo', c.default_pg_timeout, '| nccl', c.default_pg_nccl_timeout)"
echo '```'
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "No CUDA GPU is visible: nothing to check (GPU_CHECK_DEVICE=cpu runs the script on the CPU)."; exit 1
fi
: >"$OUT_DIR/runs/index.txt"
jobs_list=()
for f in lessons/[0-9][0-9]_*.py; do
  l=$(basename "$f" .py)
  a=""; [ "$l" = 12_troubleshooting ] && a="--show training"  # lesson 12 needs an exhibit group; 1 rank: training
  jobs_list+=("$l (python)|python|$f|$a" "$l (torchrun, 1 process)|torchrun|$f|$a")
done
for e in "${EXTRA[@]}"; do
  jobs_list+=("$e")
done
# 6 at a time: they share the one GPU (fine for correctness; timings here are not comparable)
printf '%s\n' "${jobs_list[@]}" | xargs -d '\n' -P 6 -I{} bash -c 'IFS="|" read -r n la le ar <<<"$1"; run_one "$n" "$la" "$le" $ar' _ {}
"$PY" benchmarks/gpu_summary.py "$OUT_DIR/runs"
