#!/usr/bin/env bash
# Runs the integration tests (tests/integration, pytest) against a private PostgreSQL + RabbitMQ
# started for the run by scripts/services.sh, or against the servers named by IDEM_PG_URL and
# IDEM_AMQP_URL when both are set (IDEM_SVC_DIR too, for the tests that restart servers).
# Builds nothing: run `make` first. Extra arguments go to pytest (e.g. -k redelivery, -x).
# Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x build/idem ]; then
  echo "integration: build/idem is missing; run make first" >&2
  exit 1
fi

# Debian's interpreter: it has pika and psycopg2 (a pyenv python3 on PATH may not).
PY=/usr/bin/python3
export PYTHONDONTWRITEBYTECODE=1
cmd=("$PY" -m pytest tests/integration "$@")

if [ -n "${IDEM_PG_URL:-}" ] && [ -n "${IDEM_AMQP_URL:-}" ]; then
  echo "integration: using the servers of IDEM_PG_URL / IDEM_AMQP_URL" >&2
  exec "${cmd[@]}"
fi
exec scripts/services.sh with - -- "${cmd[@]}"
