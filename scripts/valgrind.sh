#!/usr/bin/env bash
# The relay and the consumer under valgrind (memcheck) over a real run: events are emitted, the
# relay publishes them and the consumer applies them, then both are stopped with SIGTERM. Exit 0
# only if valgrind reports no errors and no definite or indirect leaks in either, and every event
# was applied once. Private servers, started and stopped here (scripts/services.sh).
#   scripts/valgrind.sh [EVENTS]      (default 5000; `make valgrind`)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EVENTS=${1:-5000}
if [ -z "${IDEM_PG_URL:-}" ]; then
  exec "$ROOT/scripts/services.sh" with - -- "$0" "$@"
fi
IDEM=$ROOT/build/idem
OUT=$(mktemp -d /tmp/idem-valgrind.XXXXXX)
PSQL=(/usr/lib/postgresql/15/bin/psql -X -q -v ON_ERROR_STOP=1 "$IDEM_PG_URL")
VG=(valgrind --error-exitcode=99 --leak-check=full --show-leak-kinds=definite,indirect
  --errors-for-leak-kinds=definite,indirect --track-fds=no)

"$IDEM" migrate --billing >/dev/null
"$IDEM" consume --help >/dev/null
echo "valgrind: emitting $EVENTS events" >&2
"${PSQL[@]}" -c "
  SELECT idem.idem_emit(CASE WHEN g % 3 = 0 THEN 'invoice.paid' ELSE 'payment.failed' END,
                   md5('sub' || (g % 200))::uuid, 'vg:' || g,
                   jsonb_build_object('invoice_id', md5('inv' || g)::uuid,
                                      'subscription_id', md5('sub' || (g % 200))::uuid,
                                      'amount_cents', g, 'currency', 'USD'))
    FROM generate_series(1, $EVENTS) g" >/dev/null

"${VG[@]}" --log-file="$OUT/relay.vg" "$IDEM" relay >"$OUT/relay.log" 2>&1 &
RELAY=$!
"${VG[@]}" --log-file="$OUT/consume.vg" "$IDEM" consume --consumer vg --queue vg.q \
  --bind payment.failed --bind invoice.paid --bind receipt.requested >"$OUT/consume.log" 2>&1 &
CONSUMER=$!
want=$((EVENTS + EVENTS / 3)) # invoice.paid emits a receipt.requested
for _ in $(seq 1 600); do
  got=$("${PSQL[@]}" -Atc "SELECT count(*) FROM idem.consumed_events WHERE consumer = 'vg'")
  [ "$got" -ge "$want" ] && break
  sleep 1
done
kill -TERM "$RELAY" "$CONSUMER"
rc_r=0 rc_c=0
wait "$RELAY" || rc_r=$?
wait "$CONSUMER" || rc_c=$?
got=$("${PSQL[@]}" -Atc "SELECT count(*) FROM idem.consumed_events WHERE consumer = 'vg'")
dups=$("${PSQL[@]}" -Atc "SELECT count(*) - count(DISTINCT event_id) FROM idem.consumed_events")
for f in relay consume; do
  echo "--- $f: $(grep -E 'ERROR SUMMARY' "$OUT/$f.vg" | tail -1 | sed 's/==[0-9]*== //')"
  grep -E "definitely lost|indirectly lost|possibly lost|still reachable" "$OUT/$f.vg" | sed 's/==[0-9]*== /    /' || true
done
echo "applied $got of $want events ($dups duplicates); exit codes relay $rc_r, consume $rc_c"
if [ "$rc_r" = 0 ] && [ "$rc_c" = 0 ] && [ "$got" = "$want" ] && [ "$dups" = 0 ]; then
  rm -rf "$OUT"
  echo "valgrind: PASS"
else
  echo "valgrind: FAIL (logs in $OUT)"
  exit 1
fi
