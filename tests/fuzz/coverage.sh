#!/usr/bin/env bash
# Line and branch coverage of each fuzz target's corpus over the sources it exercises:
# builds the targets with clang's source-based coverage into build/fuzz-cov/, replays
# tests/fuzz/corpus/TARGET/ plus any extra corpus folders (e.g. build/fuzz/corpus/TARGET/ after
# a long run; regress-* inputs are left out, they crash) and prints llvm-cov's report.
#   tests/fuzz/coverage.sh [CORPUS_ROOT]    (CORPUS_ROOT/TARGET/ is replayed too)
set -euo pipefail
cd "$(dirname "$0")/../.."
extra=${1:-}
out=build/fuzz-cov
make -s fuzz-build FUZZ_DIR=$out FUZZ_SAN="-fprofile-instr-generate -fcoverage-mapping" >/dev/null
declare -A files=(
  [fuzz_envelope]="src/wire/envelope.c src/util/uuid.c"
  [fuzz_billing_payload]="handlers/billing_payload.c src/util/uuid.c"
  [fuzz_amqp_url_mask]="src/adapters/rmq/rmq_url.c src/util/mask.c"
  [fuzz_props_envelope]="src/adapters/rmq/rmq_deliver.c src/adapters/rmq/rmq_publish.c src/wire/envelope.c"
)
for t in fuzz_envelope fuzz_billing_payload fuzz_amqp_url_mask fuzz_props_envelope; do
  rm -rf "$out/replay/$t" && mkdir -p "$out/replay/$t"
  find "tests/fuzz/corpus/$t" ${extra:+"$extra/$t"} -maxdepth 1 -type f ! -name 'regress-*' \
    -exec cp -n {} "$out/replay/$t/" \; 2>/dev/null || true
  n=$(find "$out/replay/$t" -type f | wc -l)
  LLVM_PROFILE_FILE="$out/$t.profraw" "$out/$t" -runs=0 "$out/replay/$t" \
    >"$out/$t.replay.log" 2>&1 || echo "$t: an input crashed, see $out/$t.replay.log" >&2
  llvm-profdata merge -sparse "$out/$t.profraw" -o "$out/$t.profdata"
  echo "== $t ($n inputs)"
  # shellcheck disable=SC2086
  llvm-cov report "$out/$t" -instr-profile="$out/$t.profdata" ${files[$t]} |
    grep -v '^---'
done
