"""A password never reaches stderr, whatever characters it holds (contract, "Security": masking
covers passwords containing any character and sslpassword).

Each case is a connection setting that a one-shot command cannot use, holding a password whose
pieces are recognisable; the command's error line must show none of them. The cases come from the
fuzz target fuzz_amqp_url_mask (tests/fuzz/corpus/fuzz_amqp_url_mask/regress-*): a blank in a
URL's password (idemp_amqp_url_parse accepts it, the mask ends the userinfo at a blank), a ','
in an AMQP password (the URL list is cut at it before the mask sees the whole URL), libpq
echoing a URI or the rest of an unquoted conninfo password in its parse errors.
"""

import pytest

from conftest import run_idem

SECRET_WORDS = ("s3cr", "Et9x", "zq7")


def cases():
    pg_refused = "postgresql://idem@127.0.0.1:1/idem"
    amqp_refused = "amqp://guest:guest@127.0.0.1:1"
    # name: (command args, environment, known defect or None; the defects found are fixed)
    return {
        "amqp_blank_bad_port": (["dlq", "list", "--queue", "q"],
                                {"IDEM_AMQP_URL": "amqp://u:s3cr Et9x@h:99999"}, None),
        "amqp_comma": (["dlq", "list", "--queue", "q"],
                       {"IDEM_AMQP_URL": "amqp://u:s3cr,Et9x@h"}, None),
        "amqp_percent_encoded": (["dlq", "list", "--queue", "q"],
                                 {"IDEM_AMQP_URL": "amqp://u:s3cr%20Et9x%2Czq7@h:99999"}, None),
        "pg_uri_blank_unparsable": (["status"],
                                    {"IDEM_PG_URL": "postgresql://u:s3cr Et9x@[::1/db"}, None),
        "pg_conninfo_unquoted_blank": (["status"],
                                       {"IDEM_PG_URL": "host=127.0.0.1 port=1 password=s3cr Et9x"},
                                       None),
        "pg_sslpassword": (["status"],
                           {"IDEM_PG_URL": "postgresql://u@[::1/db?sslpassword=s3crEt9x"}, None),
        "pg_quoted_blank": (["status"],
                            {"IDEM_PG_URL": "host=127.0.0.1 port=1 password='s3cr Et9x' bogus"},
                            None),
    }, pg_refused, amqp_refused


CASES, PG_REFUSED, AMQP_REFUSED = cases()


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=k)] if k else [])
    for n, (_, _, k) in CASES.items()])
def test_error_line_shows_no_password(name):
    args, env, _ = CASES[name]
    env = dict({"IDEM_PG_URL": PG_REFUSED, "IDEM_AMQP_URL": AMQP_REFUSED}, **env)
    r = run_idem(*args, env=env, timeout=30)
    assert r.returncode != 0, (r.stdout, r.stderr)
    out = r.stdout + r.stderr
    shown = [w for w in SECRET_WORDS if w in out]
    assert shown == [], f"exit {r.returncode}, pieces of the password {shown} in: {out!r}"
