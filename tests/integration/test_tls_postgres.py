"""TLS to PostgreSQL: libpq's parameters (sslmode, sslrootcert, sslcert, sslkey) pass through
idem unchanged, against a private server with ssl=on and a private CA (scripts/services.sh
--tls).

- sslmode=verify-full with sslrootcert=CA connects, and the server sees the daemons' sessions
  encrypted (pg_stat_ssl); sslmode=require connects encrypted too.
- A host name the certificate does not list, or a CA file that is not there, fails with one
  line naming the server and libpq's reason, exit 1; nothing is sent to an unverified server.
- The role idem_client, which pg_hba lets in only over TLS with a client certificate
  (clientcert=verify-full), works with sslcert/sslkey, and is refused with one line without
  the certificate or without TLS.
- The contract: every connect log line says tls=on or tls=off, the daemons' "connected to
  PostgreSQL" lines included (libpq's PQsslInUse tells).

Without these, idem would silently ignore TLS settings (credentials and billing data in clear),
connect to an impostor, or leave the operator unable to tell whether a link is encrypted.
"""

import psycopg2
import pytest

from conftest import IDEM, finish_daemons, wait_until
from idem_harness import Daemon, run_idem
from tls_helpers import connect_lines, one_error_line

# a PostgreSQL of its own with TLS and client certificates
pytestmark = pytest.mark.cluster


@pytest.fixture
def tls(tls_servers, tls_db):
    """(TlsServers, name of a fresh migrated database on the TLS instance)."""
    return tls_servers, tls_db


@pytest.fixture
def relays(tmp_path, request):
    """Factory: relays(tls_servers, pg_url) -> a running `idem relay` (info level) against the
    TLS instance's broker over plain AMQP; stopped after the test."""
    made = []

    def make(t, pg_url):
        d = Daemon("relay", [IDEM, "relay"], str(tmp_path), pg_url, t.amqp_url())
        made.append(d)
        d.spawn()
        wait_until(lambda: connect_lines(d.log(), "PostgreSQL") or not d.running(), 15, 0.1,
                   "the relay connected to PostgreSQL")
        assert d.running(), d.log()
        return d

    yield make
    finish_daemons(made, request)


def ssl_sessions(t, dbname):
    """[ssl] of the server's sessions of idem (application_name idem) on dbname."""
    conn = psycopg2.connect(t.pg_url("postgres"), connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
                        "WHERE a.application_name LIKE 'idem%%' AND a.datname = %s", (dbname,))
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def kv(t, dbname, host="127.0.0.1", user="postgres", **params):
    """A key/value conninfo for the TLS instance."""
    words = [f"host={host}", "hostaddr=127.0.0.1", f"port={t.pg_port}", f"dbname={dbname}",
             f"user={user}"] + [f"{k}={v}" for k, v in params.items()]
    return " ".join(words)


# ----------------------------------------------------------------------------- works


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["verify-full", "require"])
def test_tls_modes_connect_encrypted(tls, relays, mode):
    t, dbname = tls
    url = t.pg_verify_full(dbname) if mode == "verify-full" else t.pg_url(dbname, sslmode=mode)
    r = run_idem("failed", pg_url=url)
    assert r.returncode == 0, r.stderr
    relays(t, url)
    # the relay holds its connections: the server sees every one encrypted
    sessions = wait_until(lambda: ssl_sessions(t, dbname), 10, 0.1, "the relay's sessions")
    assert sessions and all(sessions), sessions


def test_client_certificate_role(tls):
    t, dbname = tls
    base = dict(sslmode="verify-full", sslrootcert=t.ca)
    ok = kv(t, dbname, host="localhost", user=t.client_user, sslcert=t.client_cert,
            sslkey=t.client_key, **base)
    r = run_idem("failed", pg_url=ok)
    assert r.returncode == 0, r.stderr
    r = run_idem("status", "--json", pg_url=ok)
    assert r.returncode == 0, r.stderr

    # without the certificate: refused by the server, one line
    r = run_idem("failed", pg_url=kv(t, dbname, host="localhost", user=t.client_user, **base))
    assert r.returncode == 1, r.stderr
    line = one_error_line(r, "failed")
    assert line.startswith(f"idem failed: cannot connect to PostgreSQL at localhost:{t.pg_port}: ")
    assert "certificate" in line, line
    # without TLS: refused, one line
    r = run_idem("failed", pg_url=kv(t, dbname, user=t.client_user, sslmode="disable"))
    assert r.returncode == 1, r.stderr
    line = one_error_line(r, "failed")
    assert "no encryption" in line or "pg_hba.conf rejects" in line, line


# ----------------------------------------------------------------------------- fails closed


def test_wrong_host_name_fails_with_one_line(tls):
    """libpq checks the certificate against host (wrong.example) while dialing hostaddr."""
    t, dbname = tls
    r = run_idem("failed", pg_url=kv(t, dbname, host="wrong.example", sslmode="verify-full",
                                      sslrootcert=t.ca))
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = one_error_line(r, "failed")
    assert line.startswith(f"idem failed: cannot connect to PostgreSQL at wrong.example:"
                           f"{t.pg_port}: "), line
    assert 'does not match host name "wrong.example"' in line, line
    assert r.stdout == ""


def test_missing_root_certificate_fails_with_one_line(tls):
    t, dbname = tls
    r = run_idem("failed", pg_url=t.pg_url(dbname, sslmode="verify-full",
                                           sslrootcert="/nonexistent/ca.pem"))
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = one_error_line(r, "failed")
    assert line.startswith(f"idem failed: cannot connect to PostgreSQL at 127.0.0.1:{t.pg_port}: ")
    assert "/nonexistent/ca.pem" in line, line


# ----------------------------------------------------------------------------- log lines


@pytest.mark.parametrize("mode,want", [("verify-full", "tls=on"), ("disable", "tls=off")])
def test_connect_line_says_tls(tls, relays, mode, want):
    """Every "connected to PostgreSQL" line of the daemon names the link's TLS state."""
    t, dbname = tls
    url = t.pg_verify_full(dbname) if mode == "verify-full" else t.pg_url(dbname, sslmode=mode)
    d = relays(t, url)
    lines = connect_lines(d.log(), "PostgreSQL")
    assert lines and all(want in line for line in lines), "\n".join(lines)

