"""Secrets stay secret: the RabbitMQ password comes from a file, and no password shows in a
process listing, a log line or an error message, whatever characters it holds.

- `--amqp-password-file PATH` and IDEM_AMQP_PASSWORD_FILE: the file's first line is the password
  and wins over the URL's (the flag over the environment); a missing or empty file is exit 1
  with one line naming the file.
- `ps -o args` of a running consumer and relay shows no password (URLs without passwords, the
  password from a file; or a URL with its password in the environment).
- Passwords holding '/', '@', ':', '%', spaces and quotes (RabbitMQ user and PostgreSQL role
  with such a password, given wrong so that connecting fails and says why) never appear in any
  line, text or JSON logs, debug level, one-shot errors or daemon retries; nor do the pieces of
  a password libpq or idem's URL parser misread (a bare '%', an unencoded '/' or ','), nor an
  sslpassword= that libpq echoes.
- PostgreSQL's password from PGPASSFILE works (nothing in the URL).

Without this, the password of a billing system's broker or database would end up in log
aggregation, shell history or `ps` output, readable by anyone who can read those.
"""

import contextlib
import json
import os
import re
import subprocess
import time
import urllib.parse
import uuid

import psycopg2
import pytest

from conftest import IDEM, admin_exec, new_id, payload, run_idem, wait_until
from idem_harness import Daemon

# A password with the characters that break naive masking: its words must never be seen.
WORDS = ["alpha1", "bravo2", "charlie3", "delta4", "echo5", "foxtrot6", "golf7", "hotel8"]
SECRET = "alpha1/bravo2@charlie3:delta4%echo5 foxtrot6'golf7\"hotel8"
WRONG = "alpha1/bravo2@charlie3:delta4%echo5 foxtrot6'golf7\"hotel8-wrong"


def enc(s):
    return urllib.parse.quote(s, safe="")


def assert_hidden(text, what=""):
    """No word of the secret (so neither the secret nor any piece of it) in text."""
    shown = [w for w in WORDS if w in text]
    assert not shown, f"{what}: the password shows ({shown}):\n{text}"


REFUSED = re.compile(r"login refused|ACCESS_REFUSED - Login was refused", re.I)


def stderr_lines(r):
    return [line for line in r.stderr.splitlines() if line.strip()]


def one_line(r, cmd):
    lines = stderr_lines(r)
    assert len(lines) == 1, f"idem {cmd}: expected one line:\n{r.stderr}"
    assert lines[0].startswith(f"idem {cmd}: "), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def rmq_secret_user(servers):
    """(user, host:port) of a RabbitMQ user whose password is SECRET, full permissions on "/";
    one for the module (no test changes it: each rabbitmqctl call costs seconds)."""
    name = f"it_secret_{uuid.uuid4().hex[:8]}"
    servers.rmqctl("add_user", name, SECRET)
    servers.rmqctl("set_permissions", "-p", "/", name, ".*", ".*", ".*")
    u = urllib.parse.urlsplit(servers.amqp_url)
    yield name, f"{u.hostname}:{u.port}"
    with contextlib.suppress(AssertionError):
        servers.rmqctl("delete_user", name)


@pytest.fixture
def pg_secret_role(servers, db):
    """(role, host, port, dbname) of a PostgreSQL login role whose password is SECRET, which
    pg_hba makes authenticate by password (scram-sha-256) on 127.0.0.1: the session's server
    trusts everyone else, so a line for this role alone goes first, and is removed afterwards."""
    if not servers.svc_dir:
        pytest.skip("needs servers started by scripts/services.sh (their pg_hba.conf)")
    role = f"it_secret_{uuid.uuid4().hex[:8]}"
    u = urllib.parse.urlsplit(db.url)
    dbname = u.path.lstrip("/")
    with psycopg2.connect(servers.db_url("postgres")) as conn, conn.cursor() as cur:
        conn.autocommit = True
        cur.execute(f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD %s", (SECRET,))
        cur.execute("SHOW hba_file")
        hba = cur.fetchone()[0]
    line = f"host all {role} 127.0.0.1/32 scram-sha-256  # it_secret\n"
    with open(hba) as f:
        before = f.read()
    with open(hba, "w") as f:
        f.write(line + before)

    def reload():
        admin_exec(servers, "SELECT pg_reload_conf()")

    def by_password():
        try:
            psycopg2.connect(host=u.hostname, port=u.port, dbname=dbname, user=role,
                             password="not-it", connect_timeout=5).close()
        except psycopg2.OperationalError as e:
            return "password authentication failed" in str(e)
        return False

    try:
        reload()
        wait_until(by_password, 10, 0.1, "pg_hba asking the role for its password")
        yield role, u.hostname, u.port, dbname
    finally:
        with open(hba) as f:
            now = f.read()
        with open(hba, "w") as f:
            f.write(now.replace(line, ""))
        reload()
        with contextlib.suppress(Exception):
            admin_exec(servers, f"DROP ROLE IF EXISTS {role}")


@pytest.fixture
def pw_file(tmp_path):
    """Factory: pw_file(text) -> the path of a file holding text (mode 0600)."""
    def make(text, name=None):
        p = tmp_path / (name or f"pw-{uuid.uuid4().hex[:6]}")
        p.write_text(text)
        p.chmod(0o600)
        return str(p)
    return make


# ----------------------------------------------------------------------------- password file


def test_password_file_overrides_the_url(db, rmq_secret_user, pw_file):
    user, hostport = rmq_secret_user
    url = f"amqp://{user}:{enc(WRONG)}@{hostport}"
    good = pw_file(SECRET + "\nthe second line is not read\n")
    crlf = pw_file(SECRET + "\r\n")
    bad = pw_file(WRONG + "\n")

    # the URL's password alone is refused: the file is what makes the difference below
    r = run_idem("relay", "--once", pg_url=db.url, amqp_url=url)
    assert r.returncode == 1 and REFUSED.search(r.stderr), r.stderr
    assert_hidden(r.stdout + r.stderr, "refused login")

    for args, env in ((["--amqp-password-file", good], None),
                      (["--amqp-password-file", crlf], None),
                      ([], {"IDEM_AMQP_PASSWORD_FILE": good}),
                      (["--amqp-password-file", good], {"IDEM_AMQP_PASSWORD_FILE": bad})):
        r = run_idem("relay", "--once", "--log-level", "debug", *args, pg_url=db.url,
                     amqp_url=url, env=env)
        assert r.returncode == 0, (args, env, r.stderr)
        assert "connected to RabbitMQ" in r.stderr
        assert_hidden(r.stdout + r.stderr, f"relay {args} {env}")
    # the environment's file, when no flag names another
    r = run_idem("relay", "--once", pg_url=db.url, amqp_url=url,
                 env={"IDEM_AMQP_PASSWORD_FILE": bad})
    assert r.returncode == 1 and REFUSED.search(r.stderr), r.stderr
    # the other AMQP commands read it too
    r = run_idem("dlq", "list", "--queue", f"it.secret.{uuid.uuid4().hex[:8]}",
                 "--amqp-password-file", good, amqp_url=url)
    assert not REFUSED.search(r.stderr), r.stderr
    assert_hidden(r.stdout + r.stderr, "dlq list")


def test_missing_or_empty_password_file_is_one_line(db, rmq_secret_user, pw_file):
    user, hostport = rmq_secret_user
    url = f"amqp://{user}@{hostport}"
    missing = f"/nonexistent/{uuid.uuid4().hex}"
    empty = pw_file("")
    for cmd, args in ((["relay"], ["--once"]),
                      (["consume"], ["--consumer", "c", "--queue", "it.secret.q"]),
                      (["dlq", "list"], ["--queue", "it.secret.q"])):
        name = " ".join(cmd)
        for how in ("flag", "env"):
            for path in (missing, empty):
                extra = ["--amqp-password-file", path] if how == "flag" else []
                env = {"IDEM_AMQP_PASSWORD_FILE": path} if how == "env" else None
                r = run_idem(*cmd, *args, *extra, pg_url=db.url, amqp_url=url, env=env,
                             timeout=30)
                assert r.returncode == 1, (name, how, path, r.stdout, r.stderr)
                line = one_line(r, name)
                assert path in line, line


def test_password_file_others_may_read_is_refused(db, rmq_secret_user, pw_file, tmp_path):
    """As libpq does for its key files: a password file that group or others may access is
    refused with one line naming it (exit 1), and nothing connects; root:group 0640 (the
    deployment kit's /etc/idem/amqp-password, owned by root) and 0600 are taken."""
    user, hostport = rmq_secret_user
    url = f"amqp://{user}@{hostport}"
    path = pw_file(SECRET + "\n")
    for mode in (0o644, 0o604, 0o660, 0o606):
        os.chmod(path, mode)
        r = run_idem("relay", "--once", "--amqp-password-file", path, pg_url=db.url,
                     amqp_url=url)
        assert r.returncode == 1, (oct(mode), r.stdout, r.stderr)
        line = one_line(r, "relay")
        assert path in line and "group or others" in line, line
        assert "connected to RabbitMQ" not in r.stderr
        assert_hidden(r.stdout + r.stderr, oct(mode))
    taken = (0o600, 0o400) + ((0o640,) if os.stat(path).st_uid == 0 else ())
    for mode in taken:
        os.chmod(path, mode)
        r = run_idem("relay", "--once", "--amqp-password-file", path, pg_url=db.url,
                     amqp_url=url)
        assert r.returncode == 0, (oct(mode), r.stderr)


# ----------------------------------------------------------------------------- ps


def ps_args(pid):
    return subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True,
                          text=True).stdout


def test_ps_never_shows_the_password(db, rmq_secret_user, pw_file, consumers, queues, broker,
                                     tmp_path):
    user, hostport = rmq_secret_user
    bare = f"amqp://{user}@{hostport}"
    f = pw_file(SECRET + "\n")
    # a consumer: URL without password on the command line, password from the file (flag)
    q = queues.new()
    c = consumers("billing", q, db, args=["--amqp", bare, "--amqp-password-file", f])
    # a relay: URL without password and the file, both from the environment
    r = Daemon("relay", [IDEM, "relay"], str(tmp_path), db.url, bare,
               env={"IDEM_AMQP_PASSWORD_FILE": f})
    r.spawn()
    # a relay with the password inside the URL, in the environment
    r2 = Daemon("relay2", [IDEM, "relay"], str(tmp_path), db.url,
                f"amqp://{user}:{enc(SECRET)}@{hostport}")
    r2.spawn()
    try:
        for d in (r, r2):
            wait_until(lambda d=d: "connected to RabbitMQ" in d.log() or not d.running(), 15, 0.1,
                       f"{d.name} connected")
            assert d.running(), d.log()
        sub = new_id()
        broker.publish_event("payment.failed", payload(subscription_id=sub))
        wait_until(lambda: db.dunning_step(sub) == 1, 15, 0.1, "the consumer logged in")
        for d in (c, r, r2):
            args = ps_args(d.proc.pid)
            assert IDEM in args, args
            assert_hidden(args, f"ps of {d.name}")
            assert enc(SECRET) not in args
            assert_hidden(d.log(), f"log of {d.name}")
    finally:
        for d in (r, r2):
            d.stop()


# ----------------------------------------------------------------------------- logs and errors


def test_wrong_rabbitmq_password_never_shown(db, rmq_secret_user, consumers, queues):
    user, hostport = rmq_secret_user
    url = f"amqp://{user}:{enc(WRONG)}@{hostport}"
    for fmt in ("text", "json"):
        r = run_idem("relay", "--once", "--log-level", "debug", "--log-format", fmt,
                     pg_url=db.url, amqp_url=url)
        assert r.returncode == 1, r.stderr
        assert f"cannot connect to RabbitMQ at {hostport}: " in r.stderr, r.stderr
        assert REFUSED.search(r.stderr), r.stderr
        assert_hidden(r.stdout + r.stderr, f"relay --once, {fmt}")
        # a daemon retrying: every attempt logged, none shows it
        c = consumers("billing", queues.new(), db, env={"IDEM_AMQP_URL": url}, start=False,
                      args=["--log-level", "debug", "--log-format", fmt])
        c.start(wait_ready=False)
        wait_until(lambda: len(REFUSED.findall(c.log())) >= 2, 15, 0.1, "two refused logins")
        assert c.stop() == 0
        assert_hidden(c.log(), f"consumer, {fmt}")
        if fmt == "json":
            for line in c.log().splitlines():
                json.loads(line)


@pytest.mark.parametrize("url", [
    # unencoded '/', '@', ':' and a space: not a valid URL, and its error prints it
    "amqp://{user}:alpha1/bravo2@charlie3:delta4 echo5@{hostport}",
    # a bare '%' that is no escape
    "amqp://{user}:alpha1%zzbravo2@{hostport}",
    # in a list of URLs, the second one's password unencoded
    "amqp://{user}:x@{hostport},amqp://{user}:alpha1/bravo2@{hostport}",
    # '://' in the password: it looks like the start of another URL
    "amqp://{user}:alpha1://bravo2@{hostport}",
    "amqp://{user}:x@{hostport},amqp://{user}:alpha1://bravo2,charlie3@{hostport}",
    "amqp://{user}:alpha1@bravo2://charlie3@{hostport}",
], ids=["slash-at-colon-space", "bare-percent", "list", "scheme-in-password",
        "scheme-and-comma-in-list", "at-and-scheme"])
def test_invalid_url_error_hides_the_password(url, db, rmq_secret_user):
    user, hostport = rmq_secret_user
    url = url.format(user=user, hostport=hostport)
    r = run_idem("relay", "--once", pg_url=db.url, amqp_url=url)
    assert r.returncode == 2, (r.returncode, r.stderr)
    line = one_line(r, "relay")
    assert "invalid AMQP URL" in line, line
    assert_hidden(r.stdout + r.stderr, url)


# An unencoded password holding "://" (it looks like the start of another URL), with '@', ',',
# quotes or a blank beside it: twelve forms, AMQP URLs and PostgreSQL URIs and conninfo. None
# parses as the user meant it; no word of the password may show in the error, text or JSON.
SCHEME_IN_PASSWORD = {
    "amqp": "amqp://u:alpha1://bravo2@{amqp}",
    "amqps": "amqps://u:alpha1://bravo2@{amqp}",
    "amqp-at": "amqp://u:alpha1@bravo2://charlie3@{amqp}",
    "amqp-list": "amqp://u:x@{amqp},amqp://u:alpha1://bravo2@{amqp}",
    "amqp-comma": "amqp://u:alpha1://bravo2,charlie3@{amqp}",
    "amqp-quotes-blank": "amqp://u:alpha1'bravo2\"://charlie3 delta4@{amqp}",
    "pg-uri": "postgresql://u:alpha1://bravo2@{pg}/{dbname}",
    "pg-uri-at": "postgres://u:alpha1@bravo2://charlie3@{pg}/{dbname}",
    "pg-uri-comma": "postgresql://u:alpha1://bravo2,charlie3@{pg}/{dbname}",
    "pg-uri-quotes": "postgresql://u:alpha1'bravo2\"://charlie3@{pg}/{dbname}",
    "pg-uri-query": "postgresql://u@{pg}/{dbname}?password=alpha1://bravo2@charlie3",
    "pg-conninfo": "host={host} port={port} dbname={dbname} user=u "
                   "password='alpha1://bravo2@charlie3, delta4'",
}


@pytest.mark.parametrize("form", sorted(SCHEME_IN_PASSWORD))
def test_scheme_in_an_unencoded_password_never_shown(form, db, servers):
    pg, amqp = urllib.parse.urlsplit(db.url), urllib.parse.urlsplit(servers.amqp_url)
    text = SCHEME_IN_PASSWORD[form].format(
        amqp=f"{amqp.hostname}:{amqp.port}", pg=f"{pg.hostname}:{pg.port}", host=pg.hostname,
        port=pg.port, dbname=pg.path.lstrip("/"))
    for fmt in ("text", "json"):
        if form.startswith("amqp"):
            r = run_idem("relay", "--once", "--log-format", fmt, pg_url=db.url, amqp_url=text)
            assert r.returncode == 2, (r.returncode, r.stderr)
            want = "invalid AMQP URL"
        else:
            r = run_idem("failed", "--log-format", fmt, pg_url=text)
            assert r.returncode == 1, (r.returncode, r.stderr)
            want = "PostgreSQL"
        lines = stderr_lines(r)
        assert len(lines) == 1 and want in lines[0], r.stderr
        if fmt == "json" and form.startswith("amqp"):  # a daemon's fatal line
            json.loads(lines[0])
        assert_hidden(r.stdout + r.stderr, f"{form}, {fmt}: {text}")


def test_comma_in_a_url_password_never_shown(db, rmq_secret_user):
    """--amqp is split on commas before each URL is parsed: a password with an unencoded ','
    must not be half printed in the "invalid AMQP URL" error."""
    user, hostport = rmq_secret_user
    r = run_idem("relay", "--once", pg_url=db.url,
                 amqp_url=f"amqp://{user}:alpha1,bravo2@{hostport}")
    assert r.returncode == 2, (r.returncode, r.stderr)
    one_line(r, "relay")
    assert_hidden(r.stdout + r.stderr, "a ',' in the password")


def test_wrong_postgres_password_never_shown(pg_secret_role, servers, tmp_path):
    role, host, port, dbname = pg_secret_role
    quoted = WRONG.replace("\\", "\\\\").replace("'", "\\'")
    forms = {
        "uri": f"postgresql://{role}:{enc(WRONG)}@{host}:{port}/{dbname}",
        "uri-query": f"postgresql://{role}@{host}:{port}/{dbname}?password={enc(WRONG)}",
        "conninfo": f"host={host} port={port} dbname={dbname} user={role} password='{quoted}'",
    }
    for name, pg in forms.items():
        for fmt in ("text", "json"):
            r = run_idem("failed", "--log-level", "debug", "--log-format", fmt, pg_url=pg)
            assert r.returncode == 1, (name, r.stdout, r.stderr)
            line = one_line(r, "failed")
            assert "password authentication failed" in line, line
            assert_hidden(r.stdout + r.stderr, f"{name}, {fmt}")
    # a daemon retrying
    d = Daemon("relay", [IDEM, "relay", "--log-level", "debug"], str(tmp_path), forms["conninfo"],
               servers.amqp_url).spawn()
    try:
        wait_until(lambda: d.log().count("password authentication failed") >= 2, 20, 0.1,
                   "two failed logins")
        assert d.running()
    finally:
        assert d.stop() == 0
    assert_hidden(d.log(), "relay daemon")


def test_password_libpq_misreads_never_shown(db):
    """A bare '%' (libpq quotes the token it cannot decode), an unencoded '/' (the rest becomes
    the port) or '@' (the rest becomes the host), and sslpassword= in a URI libpq echoes."""
    u = urllib.parse.urlsplit(db.url)
    role, host, port, dbname = "app", u.hostname, u.port, u.path.lstrip("/")
    for pg in (f"postgresql://{role}:alpha1%zzbravo2@{host}:{port}/{dbname}",
               f"postgresql://{role}:alpha1/bravo2@{host}:{port}/{dbname}",
               f"postgresql://{role}:alpha1@bravo2@{host}:{port}/{dbname}",
               f"postgresql://[::1/{dbname}?sslpassword=alpha1bravo2&sslmode=require",
               f"postgresql://{role}:alpha1@[::1/{dbname}?password=bravo2"):
        r = run_idem("failed", pg_url=pg)
        assert r.returncode == 1, (pg, r.stdout, r.stderr)
        line = one_line(r, "failed")
        # an '@' after the host ('/' in the password) is refused before libpq reads the URI
        assert "cannot connect to PostgreSQL at " in line or "invalid PostgreSQL URI" in line, line
        assert_hidden(line, pg)


def test_pgpassfile_supplies_the_postgres_password(pg_secret_role, pw_file):
    role, host, port, dbname = pg_secret_role
    esc = SECRET.replace("\\", "\\\\").replace(":", "\\:")
    passfile = pw_file(f"{host}:{port}:{dbname}:{role}:{esc}\n")
    url = f"postgresql://{role}@{host}:{port}/{dbname}"
    r = run_idem("failed", "--log-level", "debug", pg_url=url, env={"PGPASSFILE": passfile})
    assert r.returncode == 0, r.stderr
    assert_hidden(r.stdout + r.stderr, "with PGPASSFILE")
    r = run_idem("failed", pg_url=url, env={"PGPASSFILE": "/nonexistent"})
    assert r.returncode == 1, r.stderr
    assert re.search(r"password|authentication", one_line(r, "failed"))


@pytest.mark.parametrize("daemon", ["relay", "consume"])
def test_daemons_are_not_dumpable(daemon, db, servers, tmp_path):
    """A daemon holds passwords in memory: it is not dumpable (no core file, no ptrace by the
    same user). Run as an unprivileged user, its /proc files are then owned by root, as the
    kernel does for non-dumpable processes; a dumpable one's would be that user's."""
    if os.geteuid() != 0:
        pytest.fail("needs root, to start the daemon as another user (CI runs as root)")
    nobody = 65534
    args = {"relay": ["relay", "--poll-interval", "1s"],
            "consume": ["consume", "--consumer", f"c_{uuid.uuid4().hex[:8]}", "--queue",
                        f"q_{uuid.uuid4().hex[:8]}"]}[daemon]
    p = subprocess.Popen(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                          IDEM, *args],
                         env=dict(os.environ, IDEM_PG_URL=db.url, IDEM_AMQP_URL=servers.amqp_url),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 10
        uid = None
        while time.monotonic() < deadline and uid != nobody:
            with open(f"/proc/{p.pid}/status") as f:  # after exec, setpriv's pid is idem's
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            exe = os.path.basename(os.readlink(f"/proc/{p.pid}/exe"))
            if exe != "idem":
                uid = None
            time.sleep(0.05)
        assert uid == nobody, "the daemon did not start as nobody"
        time.sleep(0.3)
        assert p.poll() is None, p.stderr.read()
        assert os.stat(f"/proc/{p.pid}/environ").st_uid == 0, "the daemon is dumpable"
    finally:
        p.terminate()
        p.wait(10)
