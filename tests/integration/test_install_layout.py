"""`make install DESTDIR=... PREFIX=/usr/local` installs what the contract lists plus the
deployment kit; libidem.so is a versioned shared library (SONAME libidem.so.0) that exports the
public API and nothing else; idem.pc requires what the public headers use; `idem --version`.
No servers needed."""

import glob
import os
import re
import subprocess

from conftest import IDEM, REPO
from install_helpers import idem_version, staged  # noqa: F401  (fixture)

VERSION = idem_version()
SOMAJOR = VERSION.split(".")[0]


def expected_files():
    """Relative to PREFIX: the contract's list (bin/idem, lib/libidem.{a,so}, include/idem/,
    lib/pkgconfig/idem.pc, share/idem/sql/), the versioned library names, the deployment kit."""
    headers = {f"include/idem/{os.path.basename(h)}"
               for h in glob.glob(os.path.join(REPO, "include", "idem", "*.h"))}
    sql = {f"share/idem/sql/{os.path.relpath(s, os.path.join(REPO, 'sql'))}"
           for s in glob.glob(os.path.join(REPO, "sql", "*.sql"))
           + glob.glob(os.path.join(REPO, "sql", "billing", "*.sql"))}
    envs = {f"share/idem/env/{os.path.basename(e)}"
            for e in glob.glob(os.path.join(REPO, "deploy", "env", "*.env.example"))}
    assert headers and sql and envs
    return headers | sql | envs | {
        "bin/idem",
        "lib/libidem.a",
        "lib/libidem.so",
        f"lib/libidem.so.{SOMAJOR}",
        f"lib/libidem.so.{VERSION}",
        "lib/pkgconfig/idem.pc",
        "share/idem/systemd/idem-relay.service",
        "share/idem/systemd/idem-consume@.service",
        "share/idem/systemd/idem.sysusers.conf",
        "share/idem/idem.1",
        "share/man/man1/idem.1",
        "share/idem/grafana-idem.json",
    }


def test_make_install_installs_everything_listed(staged):
    got = staged.files()
    want = expected_files()
    assert sorted(want - got) == [], "missing from the install"
    assert sorted(got - want) == [], "installed but not expected"
    assert os.access(staged.bin, os.X_OK)
    # the usual library links: libidem.so -> libidem.so.X.Y.Z, libidem.so.X -> libidem.so.X.Y.Z
    real = f"libidem.so.{VERSION}"
    assert not os.path.islink(staged.path("lib", real))
    for link in ("libidem.so", f"libidem.so.{SOMAJOR}"):
        assert os.readlink(staged.path("lib", link)) == real, link
    # nothing was left unsubstituted in the generated files
    for rel in ("lib/pkgconfig/idem.pc", "share/idem/idem.1", "share/man/man1/idem.1",
                "share/idem/systemd/idem-relay.service",
                "share/idem/systemd/idem-consume@.service"):
        with open(staged.path(rel)) as f:
            text = f.read()
        assert not re.search(r"@[A-Z]+@", text), f"placeholder left in {rel}"


def readelf_soname(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                         check=True).stdout
    m = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", out)
    return m.group(1) if m else None


def exported_symbols(path):
    """`nm -D --defined-only PATH`: the names of the defined dynamic symbols."""
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                         check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip())


def public_functions():
    """Every idem_* function declared in include/idem/*.h (comments stripped)."""
    names = set()
    for h in glob.glob(os.path.join(REPO, "include", "idem", "*.h")):
        with open(h) as f:
            src = re.sub(r"/\*.*?\*/", " ", f.read(), flags=re.S)
        # a name followed by "(", but not a type followed by "(*name)" (a function pointer)
        names |= set(re.findall(r"(?<![\w*])(idem_[a-z0-9_]+)\s*\((?!\s*\*)", src))
    assert names
    return names


def test_shared_library_soname_and_exports(staged):
    built = os.path.join(os.path.dirname(IDEM), "libidem.so")
    for lib in (built, staged.path("lib", "libidem.so")):
        assert readelf_soname(lib) == f"libidem.so.{SOMAJOR}", lib
        syms = exported_symbols(lib)
        print(f"nm -D --defined-only {lib}: {len(syms)} symbols, all idem_*: "
              f"{all(s.startswith('idem_') for s in syms)}")
        not_api = [s for s in syms if not s.startswith("idem_")]
        assert not_api == [], f"{lib} exports names outside the public API"
        missing = sorted(public_functions() - set(syms))
        assert missing == [], f"{lib} does not export functions of include/idem/"


def test_pkg_config_requires_what_the_headers_use(staged):
    assert staged.pkg_config("--modversion", "idem") == VERSION
    requires = staged.pkg_config("--print-requires", "idem").split()
    assert sorted(requires) == ["jansson", "libpq"]
    private = staged.pkg_config("--print-requires-private", "idem").split()
    assert {"librabbitmq", "openssl"} <= set(private)
    libs = staged.pkg_config("--libs", "idem")
    print(f"pkg-config --libs idem: {libs}")
    flags = libs.split()
    for want in ("-lidem", "-lpq", "-ljansson"):
        assert want in flags, f"{want} not in {libs!r}"
    assert "-lrabbitmq" not in flags and "-lssl" not in flags
    static = staged.pkg_config("--static", "--libs", "idem").split()
    for want in ("-lidem", "-lpq", "-ljansson", "-lrabbitmq", "-lssl"):
        assert want in static, f"{want} not in pkg-config --static --libs idem"
    cflags = staged.pkg_config("--cflags", "idem").split()
    assert f"-I{staged.path('include')}" in cflags
    assert any(f.endswith("/include/postgresql") for f in cflags), cflags


def test_version_flag(staged):
    for binary in (IDEM, staged.bin):
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                           env=staged.run_env())
        assert (r.returncode, r.stdout, r.stderr) == (0, f"idem {VERSION}\n", ""), binary
    r = subprocess.run([IDEM, "--help"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0
    assert re.search(r"^\s+--version\s", r.stdout, re.M), "idem --help does not list --version"


def test_installed_modes_do_not_follow_the_umask(tmp_path):
    """Under umask 000 (and 002) every installed file is 0644, programs and shared libraries
    0755, directories 0755: a group- or world-writable idem.pc would let any local user inject
    flags into every build that runs `pkg-config idem`."""
    from install_helpers import require_default_build
    require_default_build()
    for mask in (0o000, 0o002):
        dest = tmp_path / f"umask{mask:03o}"
        old = os.umask(mask)
        try:
            r = subprocess.run(["make", "-s", "--no-print-directory", "-C", REPO, "install",
                                "PREFIX=/usr/local", f"DESTDIR={dest}"],
                               capture_output=True, text=True, timeout=900)
        finally:
            os.umask(old)
        assert r.returncode == 0, r.stdout + r.stderr
        for root, dirs, files in os.walk(dest):
            for name in dirs + files:
                p = os.path.join(root, name)
                if os.path.islink(p):
                    continue
                mode = os.stat(p).st_mode & 0o7777
                rel = os.path.relpath(p, dest)
                assert not mode & 0o022, f"{rel} is {mode:04o} under umask {mask:03o}"
                if os.path.isdir(p) or name == "idem" or ".so." in name:
                    assert mode == 0o755, f"{rel} is {mode:04o}"
                else:
                    assert mode == 0o644, f"{rel} is {mode:04o}"
