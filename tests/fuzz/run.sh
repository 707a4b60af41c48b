#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS of fuzzing from its committed corpus
# (tests/fuzz/corpus/NAME/, read only) and a work corpus (DIR/corpus/NAME/, DIR being the
# binary's folder: new inputs),
# with crashes saved to DIR/artifacts/NAME/.
#   tests/fuzz/run.sh build/fuzz/fuzz_envelope SECONDS [-- more libFuzzer flags]
# With IDEM_FUZZ_KEEP_GOING=1 a crash is recorded and fuzzing resumes until SECONDS are spent
# (for long runs); otherwise the first crash ends the run. Exit 1 if any input crashed.
set -uo pipefail
bin=$1
secs=${2:-60}
shift 2 || true
[ "${1:-}" = "--" ] && shift
name=$(basename "$bin")
here=$(cd "$(dirname "$0")" && pwd)
seed="$here/corpus/$name"
out=$(cd "$(dirname "$bin")" && pwd)
work="$out/corpus/$name"
art="$out/artifacts/$name"
mkdir -p "$work" "$art"
dirs=("$work" "$seed")
if [ "${IDEM_FUZZ_KEEP_GOING:-0}" = 1 ]; then
  # long runs: the committed inputs that crash (regress-*) would end every restart at once
  find "$seed" -maxdepth 1 -type f ! -name 'regress-*' -exec cp -n {} "$work/" \;
  dirs=("$work")
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
log="$out/$name.log"
: >"$log"
start=$(date +%s)
crashed=0
while :; do
  left=$((secs - ($(date +%s) - start)))
  [ "$left" -le 0 ] && break
  "$bin" -max_total_time="$left" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
    -artifact_prefix="$art/" -print_final_stats=1 "$@" "${dirs[@]}" >>"$log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] && break
  crashed=1
  echo "fuzz: $name: an input crashed (exit $rc); see $log and $art/" >&2
  [ "${IDEM_FUZZ_KEEP_GOING:-0}" = 1 ] || break
done
stats=$(grep -E '^stat::number_of_executed_units|^#[0-9]+.*(DONE|cov:)' "$log" | tail -n 2 | tr '\n' ' ')
echo "fuzz: $name: ${stats:-no stats} (log $log)" >&2
exit $crashed
