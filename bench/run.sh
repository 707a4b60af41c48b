#!/usr/bin/env bash
# bench/run.sh - kept for habit: bench/bench.py starts its own servers now (see its --help).
exec /usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/bench.py" "$@"
