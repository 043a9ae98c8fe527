#!/usr/bin/env bash
# kvserve on a GPU, in one run that goes on past a failure: the engine-equivalence tests on
# CUDA, then `kvserve bench suite --only engine_vs_transformers roofline` on a random
# Llama of Llama 3.2 1B's shape in bf16 (docs/performance.md, "On a GPU").
#
#   scripts/cuda-check.sh OUT_DIR
#
# Writes OUT_DIR/summary.txt (each stage's exit status and time), the bench's results.md
# and results.json, and OUT_DIR/cuda-check.tar.gz with every log and plot. Run from the
# repository root with a python3 that has torch (CUDA), transformers, safetensors,
# tokenizers, pytest, peft, hypothesis, httpx, msgspec, llguidance and jsonschema; kvserve
# runs from the tree (PYTHONPATH).
# Settings (environment): DEVICE (cuda), SHAPE (1b), DTYPE (bfloat16), ROUNDS (2),
# STAGES (all four: "environment equivalence bench engine-tests"; a device call whose
# machine is lost brings nothing back, so two shorter calls can split them), and SMOKE=1
# for tiny sizes, to check this script on a machine without a GPU.
set -u
out=${1:?usage: scripts/cuda-check.sh OUT_DIR}
device=${DEVICE:-cuda} shape=${SHAPE:-1b} dtype=${DTYPE:-bfloat16} rounds=${ROUNDS:-2}
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH="service:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVSERVE_TEST_DEVICE=$device

# stage NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output in NAME.log.
stage() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    case " ${STAGES:-environment equivalence bench engine-tests} " in
        *" $name "*) ;;
        *) return ;;
    esac
    echo "== $name (at most $limit s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc$([ $rc = 124 ] && echo ' (timed out)') in $((SECONDS - start)) s" |
        tee -a "$out/summary.txt"
}

pytest=(python3 -m pytest -q -rfE -p no:cacheprovider -o faulthandler_timeout=60)
smoke=()
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke)

stage environment 30 bash -c 'nvidia-smi || true; python3 -c "
import sys, torch, transformers
print(sys.version.split()[0], torch.__version__, transformers.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.version.cuda)
"'
# Greedy fp32 tokens equal transformers' on the same device (base models and LoRA).
stage equivalence 150 "${pytest[@]}" tests/engine/test_hf_equivalence.py \
    tests/lora/test_hf_peft_equivalence.py
stage bench 300 python3 -m kvserve bench suite "${smoke[@]}" --device "$device" \
    --model-shape "$shape" --dtype "$dtype" --rounds "$rounds" \
    --only engine_vs_transformers roofline --out "$work/bench"
# Speculative decoding's exactness, structured outputs' masks and the fp8 KV cache's
# accuracy, on the device (not the test of `kvserve serve`: GPU images may lack fastapi).
stage engine-tests 90 "${pytest[@]}" tests/engine/test_speculative.py \
    tests/engine/test_structured_outputs.py tests/engine/test_kv_cache_dtype.py \
    -k "not test_serve_flag_sizes_the_pool"

cp "$work"/bench/results.md "$work"/bench/results.json "$out"/ 2>/dev/null
tar -czf "$out/cuda-check.tar.gz" -C "$work" .
for log in equivalence engine-tests bench; do
    [ -f "$work/$log.log" ] && echo "== $log.log (end)" && tail -n 12 "$work/$log.log"
done
echo "== results.md" && cat "$out/results.md" 2>/dev/null
echo "== summary" && cat "$out/summary.txt"
rm -rf "$work"
