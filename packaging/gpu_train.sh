#!/usr/bin/env bash
# One GPU session's drafter training (issue 44), in at most ~9 minutes on one H100/H200:
#   1. distil new answers of the default target (greedy + 3 sampled at 0.6, 0.9, 1.2) into token-id
#      shards, for at most DISTIL_S seconds (every answer made is kept; a rerun resumes);
#   2. train EAGLE, EAGLE-3 (training-time test over 2 passes), DFlash and Medusa heads from every shard
#      (the committed data/distilled ones and the new), KINDS="eagle eagle3 dflash medusa" to choose;
#   3. leave heads, model cards and the new shards in OUT, small enough to bring back and commit.
#
#   packaging/gpu_train.sh [OUT]                     # on the GPU machine (--device cuda)
#   packaging/gpu_train.sh --tiny --device cpu [OUT]  # seconds, on a CPU: a tiny random target (tests)
#
# Environment: PYTHON (default python3, with speclens importable), DISTIL_S (default 300).
set -euo pipefail
cd "$(dirname "$0")/.."
tiny=0 device=cuda out=gpu-train
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1 ;;
    --device) device="$2"; shift ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) out="$1" ;;
  esac
  shift
done
py=${PYTHON:-python3}
mkdir -p "$out/shards"
log() { echo "[gpu_train $(date +%H:%M:%S)] $*" >&2; }

if [ "$tiny" = 1 ]; then
  # a tiny random Llama and eight prompts: the same commands, in seconds
  "$py" - "$out" <<'EOF'
import json, sys
from pathlib import Path
from tests.tiny import tiny_llama, tiny_tokenizer
out = Path(sys.argv[1])
tiny_llama(seed=0).save_pretrained(out / "tiny-target")
tiny_tokenizer().save_pretrained(out / "tiny-target")
(out / "prompts.jsonl").write_text("\n".join(json.dumps({"instruction": f"Count to {i}."}) for i in range(8)))
EOF
  target="$out/tiny-target" prompts="$out/prompts.jsonl" committed=""
  distil=(--answer-tokens 6 --batch-size 4 --sampled-answers 1 --sample-temperatures 0.9 --held-out 0)
  train=(--answer-tokens 6 --batch-size 4 --epochs 1 --held-out 2 --eval-tokens 0 --depth 3 --draft-vocab 0 --distil-seconds 5)
  distil_s=${DISTIL_S:-60}
else
  target=default prompts=resources/prompts/self-prompts-smollm2.jsonl committed=data/distilled/smollm2-135m-instruct
  distil=(--answer-tokens 256 --batch-size 512 --sampled-answers 3 --sample-temperatures 0.6,0.9,1.2 --held-out 0
          --distil-dtype bfloat16)
  train=(--batch-size 512 --tokens-per-step 8192 --epochs 2 --held-out 20 --eval-tokens 0 --distil-seconds 20)
  distil_s=${DISTIL_S:-300}
fi
shards=(--shards "$out/shards")
[ -n "$committed" ] && shards+=(--shards "$committed")

log "distilling for at most ${distil_s}s into $out/shards"
"$py" -m speclens.app train-drafter --kind eagle --target "$target" --prompts "$prompts" --out "$out/distil" \
  --device "$device" --distil-only --distil-seconds "$distil_s" "${distil[@]}" "${shards[@]}"
for kind in ${KINDS:-eagle eagle3 dflash medusa}; do
  log "training $kind from every shard"
  extra=()
  [ "$kind" = eagle3 ] && extra=(--unroll 2)
  "$py" -m speclens.app train-drafter --kind "$kind" --target "$target" --prompts "$prompts" --out "$out/$kind" \
    --device "$device" "${train[@]}" "${extra[@]}" "${shards[@]}"
done
# what comes back: heads, cards, training records and the new shards (not the distillation state)
rm -rf "$out/distil" "$out"/*/checkpoint.pt "$out"/*/distilled*.pt "$out"/*/held-out.pt
log "done: $(du -sh "$out" | cut -f1) in $out"
ls -R "$out" >&2
