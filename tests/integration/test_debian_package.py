"""The Debian packages, as a Debian user gets them: `dpkg-buildpackage` (debhelper, debian/) on a
copy of the checkout builds libidem0, libidem-dev and idem; `dpkg -i` installs them on this
machine; then, from the installed files only (no checkout, no LD_LIBRARY_PATH, no IDEM_SQL_DIR):

- `/usr/bin/idem --version`, the manual (`man -w idem`), the systemd units naming /usr/bin/idem,
  the system user from the sysusers.d entry;
- `idem migrate --billing` from /usr/share/idem/sql into an empty database, then `idem emit`,
  `idem relay` and `idem consume` (the bundled handlers): every event applied once;
- a C program built with `cc prog.c $(pkg-config --cflags --libs idem)` against libidem-dev,
  run against the dynamic libidem.so.0 of libidem0.

At the end the packages are purged and the system user they created is removed: the machine is
left as it was found. Needs root (dpkg) and the packages of scripts/deps.sh (debhelper, lintian).
"""

import contextlib
import glob
import grp
import json
import os
import pwd
import re
import shutil
import subprocess
import uuid

import pytest

from conftest import REPO, Consumer, Daemon, Db, admin_exec, finish_daemons, new_id, payload, \
    wait_until
from install_helpers import idem_version, require_default_build

PACKAGES = ("libidem0", "libidem-dev", "idem")
BIN = "/usr/bin/idem"
SQL_DIR = "/usr/share/idem/sql"
VERSION = idem_version()
# The build: no unit tests (make test runs them), no debug-symbol packages, both CPUs.
BUILD_OPTIONS = "nocheck noddebs parallel=2"


def run(argv, timeout=120, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def clean_env(**extra):
    """The environment of a user of the installed packages: none of the test run's pointers
    into the checkout or a staging tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("IDEM_SQL_DIR", "IDEM_FAULT", "IDEM_BIN", "LD_LIBRARY_PATH",
                        "PKG_CONFIG_PATH", "PKG_CONFIG_SYSROOT_DIR", "PKG_CONFIG_LIBDIR",
                        "C_INCLUDE_PATH", "CPATH", "LIBRARY_PATH")}
    env.update(extra)
    return env


def copy_checkout(dest):
    """The files of the work tree that git tracks or would track (so uncommitted changes are
    built too, build output is not), or the whole tree less build directories outside git."""
    r = run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    if r.returncode == 0 and r.stdout:
        for rel in r.stdout.split("\0"):
            src = os.path.join(REPO, rel)
            if not rel or not os.path.lexists(src):
                continue  # deleted but not yet committed
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            if os.path.islink(src):
                os.symlink(os.readlink(src), os.path.join(dest, rel))
            else:
                shutil.copy2(src, os.path.join(dest, rel))
    else:
        shutil.copytree(REPO, dest, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", "build", "build-*", "__pycache__", ".pytest_cache"))


def multiarch():
    return run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"], check=True).stdout.strip()


def installed_status(pkg):
    r = run(["dpkg-query", "-W", "-f=${Status}", pkg])
    return r.stdout.strip() if r.returncode == 0 else ""


def user_exists(name):
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def group_exists(name):
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    """dpkg-buildpackage -us -uc -b on a copy of the checkout: {package: path of its .deb}."""
    require_default_build()
    for tool in ("dpkg-buildpackage", "dh", "lintian"):
        assert shutil.which(tool), f"{tool} is missing (scripts/deps.sh installs it)"
    top = tmp_path_factory.mktemp("deb")
    src = str(top / f"idem-{VERSION}")
    copy_checkout(src)
    r = run(["nice", "-n", "19", "dpkg-buildpackage", "-us", "-uc", "-b"], timeout=1800, cwd=src,
            env=clean_env(DEB_BUILD_OPTIONS=BUILD_OPTIONS))
    assert r.returncode == 0, f"dpkg-buildpackage failed:\n{r.stdout[-6000:]}{r.stderr[-4000:]}"
    out = {}
    for path in glob.glob(str(top / "*.deb")):
        name, version, _ = os.path.basename(path)[:-4].split("_")
        assert version == VERSION, f"{path}: debian/changelog's version is not IDEM_VERSION"
        out[name] = path
    assert sorted(out) == sorted(PACKAGES), sorted(out)
    out["_changes"] = glob.glob(str(top / "*.changes"))[0]
    return out


@pytest.fixture(scope="module")
def installed(debs):
    """The three packages installed with dpkg -i; purged afterwards (and the user idem that
    their postinst created removed, when it did not exist before)."""
    if os.geteuid() != 0:
        pytest.skip("installing .deb packages needs root")
    for pkg in PACKAGES:
        st = installed_status(pkg)
        assert st in ("", "unknown ok not-installed", "deinstall ok config-files"), \
            f"{pkg} is already on this machine ({st}); purge it first, the test purges its own"
    assert not os.path.lexists(BIN), f"{BIN} exists already (not from a package of ours)"
    had_user, had_group = user_exists("idem"), group_exists("idem")
    try:
        r = run(["dpkg", "-i", *(debs[p] for p in PACKAGES)], timeout=300)
        assert r.returncode == 0, f"dpkg -i failed:\n{r.stdout}{r.stderr}"
        yield {"had_user": had_user}
    finally:
        r = run(["dpkg", "--purge", *PACKAGES], timeout=300)
        if not had_user and user_exists("idem"):
            run(["userdel", "idem"])
        if not had_group and group_exists("idem"):
            run(["groupdel", "idem"])
        assert r.returncode == 0, f"dpkg --purge failed:\n{r.stdout}{r.stderr}"
        for pkg in PACKAGES:
            assert installed_status(pkg) in ("", "unknown ok not-installed"), pkg
        assert not os.path.lexists(BIN)


def package_files(pkg):
    r = run(["dpkg-query", "-L", pkg])
    assert r.returncode == 0, r.stderr
    return {ln for ln in r.stdout.splitlines() if ln and ln != "/."}


def test_lintian_reports_no_errors_or_warnings(debs):
    r = run(["lintian", "-I", "--no-tag-display-limit", debs["_changes"]], timeout=600)
    tags = [ln for ln in r.stdout.splitlines() if re.match(r"^[EW]: ", ln)]
    print(f"lintian: {r.stdout.strip() or 'no tags'}")
    assert tags == [], "lintian:\n" + "\n".join(tags)


def test_packages_hold_the_library_the_headers_and_the_command(installed):
    ma = multiarch()
    lib = package_files("libidem0")
    assert f"/usr/lib/{ma}/libidem.so.{VERSION}" in lib
    assert f"/usr/lib/{ma}/libidem.so.0" in lib
    assert not any(f.endswith((".a", "/libidem.so", ".pc", ".h")) for f in lib), sorted(lib)
    soname = run(["objdump", "-p", f"/usr/lib/{ma}/libidem.so.0"], check=True).stdout
    assert re.search(r"SONAME\s+libidem\.so\.0$", soname, re.M)

    dev = package_files("libidem-dev")
    headers = {f"/usr/include/idem/{os.path.basename(h)}"
               for h in glob.glob(os.path.join(REPO, "include", "idem", "*.h"))}
    assert headers and headers <= dev, sorted(headers - dev)
    for f in (f"/usr/lib/{ma}/libidem.a", f"/usr/lib/{ma}/libidem.so",
              f"/usr/lib/{ma}/pkgconfig/idem.pc"):
        assert f in dev, f
    assert os.readlink(f"/usr/lib/{ma}/libidem.so") == f"libidem.so.{VERSION}"

    cmd = package_files("idem")
    sql = {f"{SQL_DIR}/{os.path.relpath(s, os.path.join(REPO, 'sql'))}"
           for s in glob.glob(os.path.join(REPO, "sql", "*.sql"))
           + glob.glob(os.path.join(REPO, "sql", "billing", "*.sql"))}
    want = sql | {BIN, "/usr/share/man/man1/idem.1.gz", "/lib/systemd/system/idem-relay.service",
                  "/lib/systemd/system/idem-consume@.service", "/usr/lib/sysusers.d/idem.conf",
                  "/usr/share/idem/grafana-idem.json", "/usr/share/idem/env/idem.env.example",
                  "/usr/share/doc/idem/copyright"}
    assert sorted(want - cmd) == [], "missing from package idem"
    for unit, start in (("idem-relay.service", f"{BIN} relay "),
                        ("idem-consume@.service", f"{BIN} consume --consumer %i ")):
        with open(f"/lib/systemd/system/{unit}") as f:
            text = f.read()
        assert f"\nExecStart={start}" in text, unit
        assert not re.search(r"@[A-Z]+@", text), f"placeholder left in {unit}"
    # installed, not enabled: the units need /etc/idem/idem.env first
    assert not glob.glob("/etc/systemd/system/*/idem-relay.service")
    # the postinst created the system user the units run as (sysusers.d)
    entry = pwd.getpwnam("idem")
    assert entry.pw_shell == "/usr/sbin/nologin" and entry.pw_uid < 1000, entry


def test_installed_version_and_manual(installed):
    r = run([BIN, "--version"], env=clean_env(), cwd="/")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"idem {VERSION}\n", "")
    libs = run(["ldd", BIN], check=True).stdout
    assert "not found" not in libs, libs
    r = run(["man", "-w", "idem"], env=clean_env(MANPATH="/usr/share/man"))
    assert (r.returncode, r.stdout.strip()) == (0, "/usr/share/man/man1/idem.1.gz"), r.stderr
    r = run(["man", "idem"], env=clean_env(MANPAGER="cat", PAGER="cat", MANWIDTH="80"))
    assert r.returncode == 0 and "idem migrate" in r.stdout and VERSION in r.stdout


@pytest.fixture
def fresh_db(servers):
    """An empty database (no idem schema)."""
    name = "deb_" + uuid.uuid4().hex[:16]
    admin_exec(servers, f'CREATE DATABASE "{name}"')
    yield Db(servers.db_url(name))
    with contextlib.suppress(Exception):
        admin_exec(servers, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def daemons(request):
    started = []
    yield started
    finish_daemons(started, request)


def test_installed_migrate_relay_consume_round_trip(installed, fresh_db, servers, broker, queue,
                                                    tmp_path, daemons):
    db = fresh_db
    env = clean_env(IDEM_PG_URL=db.url, IDEM_AMQP_URL=servers.amqp_url)

    def idem(*args):
        return run([BIN, *args], env=env, cwd=str(tmp_path), timeout=60)

    # idem migrate finds the migrations in /usr/share/idem/sql by itself
    r = idem("migrate", "--billing")
    assert r.returncode == 0, r.stderr
    files = sorted(os.path.basename(f) for f in glob.glob(f"{SQL_DIR}/*.sql"))
    assert files
    for name in files:
        assert re.search(rf"^applied {re.escape(name)}\b", r.stdout, re.M), r.stdout
    assert "billing" in r.stdout, r.stdout
    r = idem("migrate", "--billing", "--status")
    assert r.returncode == 0 and not re.search(r"^pending ", r.stdout, re.M), r.stdout + r.stderr

    def daemon(kind, argv):
        d = kind(*argv)
        d.argv[0] = BIN
        d.env = dict(env)
        daemons.append(d)
        return d

    consumer = daemon(Consumer, ("billing", queue, db, servers, broker, str(tmp_path)))
    consumer.start()
    relay = daemon(Daemon, ("relay", [BIN, "relay"], db, servers, str(tmp_path)))
    relay.spawn()

    sub_a, sub_b = new_id(), new_id()
    events = [("payment.failed", sub_a, f"pf:{sub_a}:1"), ("payment.failed", sub_a, f"pf:{sub_a}:2"),
              ("payment.failed", sub_b, f"pf:{sub_b}:1"), ("payment.failed", sub_a, f"pf:{sub_a}:1")]
    ids = []
    for etype, sub, key in events:
        r = idem("emit", "--type", etype, "--subscription", sub, "--key", key, "--payload",
                 json.dumps(payload(subscription_id=sub)))
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.strip())
    assert ids[3] == ids[0], "a replayed emit returns the same event id"
    wait_until(lambda: db.dunning_step(sub_a) == 2 and db.dunning_step(sub_b) == 1, 30, 0.1,
               lambda: f"dunning A=2, B=1 (now A={db.dunning_step(sub_a)}, "
                       f"B={db.dunning_step(sub_b)})\nrelay:\n{relay.log()[-2000:]}")
    consumer.wait_handled(3)
    assert db.ledger() == sorted(("billing", i) for i in set(ids))
    assert db.count("idem.event_outbox", "status = 'sent'") == 3
    assert consumer.metric("idem_consumer_duplicates_total") == 0
    assert consumer.stop() == 0 and relay.stop() == 0
    assert broker.depth(queue) == 0


PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <idem/idem.h>

/* Parses a duration, then asks the database which of the installed migrations are pending. */
int main(int argc, char **argv) {
    int64_t ms = 0;
    if (argc != 3 || idem_duration_parse("90s", false, &ms) != 0 || ms != 90000) {
        fprintf(stderr, "idem_duration_parse\n");
        return 1;
    }
    PGconn *conn = PQconnectdb(argv[1]);
    if (PQstatus(conn) != CONNECTION_OK) {
        fprintf(stderr, "connect: %s", PQerrorMessage(conn));
        return 1;
    }
    idem_error_t err = {0};
    int pending = -1;
    if (idem_migrate_status(conn, argv[2], IDEM_MIGRATE_BILLING, stdout, &pending, &err) != 0) {
        fprintf(stderr, "idem_migrate_status: %s\n", err.text);
        PQfinish(conn);
        return 1;
    }
    printf("version %s pending %d\n", IDEM_VERSION, pending);
    PQfinish(conn);
    return 0;
}
"""


def test_c_program_builds_against_the_dev_package(installed, fresh_db, tmp_path):
    src, prog = tmp_path / "prog.c", tmp_path / "prog"
    src.write_text(PROGRAM)
    env = clean_env()
    r = run(["sh", "-c", 'cc -Wall -Wextra -Werror "$1" $(pkg-config --cflags --libs idem) '
             '-o "$2"', "sh", str(src), str(prog)], env=env, cwd=str(tmp_path))
    assert r.returncode == 0, f"cc prog.c $(pkg-config --cflags --libs idem):\n{r.stderr}"
    r = run(["pkg-config", "--modversion", "idem"], env=env)
    assert r.stdout.strip() == VERSION
    # the loader finds libidem0's library (through /lib when /lib is a link to /usr/lib)
    ldd = run(["ldd", str(prog)], check=True).stdout
    m = re.search(r"^\s*libidem\.so\.0 => (\S+)", ldd, re.M)
    assert m, ldd
    assert os.path.realpath(m.group(1)) == \
        os.path.realpath(f"/usr/lib/{multiarch()}/libidem.so.0"), ldd
    r = run([str(prog), fresh_db.url, SQL_DIR], env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    n = len(glob.glob(f"{SQL_DIR}/*.sql")) + len(glob.glob(f"{SQL_DIR}/billing/*.sql"))
    assert f"version {VERSION} pending {n}\n" in r.stdout, r.stdout
