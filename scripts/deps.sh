#!/usr/bin/env bash
# Installs the Debian packages idem needs to build and test, if any is missing.
# Quiet when everything is already installed. Needs root (CI and the dev machines run as root).
set -euo pipefail

# Everything `make test`, `make test-slow`, .ci/run and `make demo` call: a minimal Debian 12 lacks
# the last line's packages too (ps; systemd-analyze, groff and man for the deployment kit's tests).
# chromium and python3-websocket: the console's browser tests (headless, over DevTools).
# debhelper, dpkg-dev and lintian: the Debian packages' test builds debian/ and checks it.
pkgs=(
  build-essential make pkg-config clang-format
  postgresql-15 postgresql rabbitmq-server
  librabbitmq-dev libjansson-dev libcmocka-dev libpq-dev libssl-dev
  amqp-tools python3 python3-pika python3-psycopg2 python3-pytest openssl valgrind
  faketime pgbouncer gnuplot-nox
  procps systemd groff-base man-db
  chromium python3-websocket
  debhelper dpkg-dev lintian
)
# make fuzz: libFuzzer comes with Debian's clang (not needed to build or test)
if [ "${1:-}" = "--fuzz" ]; then
  pkgs+=(clang libclang-rt-14-dev)
fi

missing=()
for p in "${pkgs[@]}"; do
  # "install ok installed" only: a removed-but-configured package still answers dpkg -s.
  st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$st" = "install ok installed" ] || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps: installing ${missing[*]}" >&2
if [ "$(id -u)" -ne 0 ]; then
  echo "deps: need root to install: ${missing[*]}" >&2
  exit 1
fi

# Do not let the packages' maintainer scripts start system-wide services: we run private
# instances on our own ports. policy-rc.d exit 101 = "action forbidden" for invoke-rc.d.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  own_policy=1
fi
cleanup() { if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
apt-get update -q >&2
apt-get install -y -q "${missing[@]}" </dev/null >&2
