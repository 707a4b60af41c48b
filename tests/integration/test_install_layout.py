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


def make(*args, env=None, timeout=900):
    r = subprocess.run(["make", "--no-print-directory", "-C", REPO, *args], capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def tree(root):
    """(files and symlinks, directories) under root, relative to it."""
    files, dirs = set(), set()
    for d, ds, fs in os.walk(root):
        for name in fs + [x for x in ds if os.path.islink(os.path.join(d, x))]:
            files.add(os.path.relpath(os.path.join(d, name), root))
        dirs |= {os.path.relpath(os.path.join(d, x), root) for x in ds
                 if not os.path.islink(os.path.join(d, x))}
    return files, dirs


def test_libdir_then_uninstall_leaves_nothing(tmp_path):
    """LIBDIR puts the libraries and idem.pc where a distribution wants them (idem.pc says so);
    `make uninstall` with the same variables removes every installed file and nothing else (a
    file of another package in a shared directory stays, so do the directories)."""
    from install_helpers import require_default_build
    require_default_build()
    dest = str(tmp_path / "stage")
    other = os.path.join(dest, "usr", "share", "man", "man1", "other.1")
    os.makedirs(os.path.dirname(other))
    with open(other, "w") as f:
        f.write("another package's page\n")
    libdir = "/usr/lib/x86_64-linux-gnu"
    make("-s", "install", f"DESTDIR={dest}", "PREFIX=/usr", f"LIBDIR={libdir}")
    files, _ = tree(dest)
    rel_lib = libdir.lstrip("/")
    for name in ("libidem.a", "libidem.so", f"libidem.so.{SOMAJOR}", f"libidem.so.{VERSION}",
                 "pkgconfig/idem.pc"):
        assert f"{rel_lib}/{name}" in files, name
    assert not any(f.startswith("usr/lib/lib") or f.startswith("usr/lib/pkgconfig")
                   for f in files), sorted(files)
    with open(os.path.join(dest, rel_lib, "pkgconfig", "idem.pc")) as f:
        pc = f.read()
    assert re.search(r"^libdir=\$\{prefix\}/lib/x86_64-linux-gnu$", pc, re.M), pc
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(dest, rel_lib, "pkgconfig"),
               PKG_CONFIG_SYSROOT_DIR=dest)
    libs = subprocess.run(["pkg-config", "--libs", "idem"], capture_output=True, text=True,
                          env=env, check=True).stdout.split()
    assert f"-L{dest}{libdir}" in libs, libs

    make("-s", "uninstall", f"DESTDIR={dest}", "PREFIX=/usr", f"LIBDIR={libdir}")
    files, dirs = tree(dest)
    print(f"after uninstall: files {sorted(files)}, {len(dirs)} directories")
    assert files == {"usr/share/man/man1/other.1"}, sorted(files)
    assert "usr/share/man/man1" in dirs


def dry_run(*args, env=None):
    """The commands `make -n -B all` would run into a scratch build directory."""
    out = make("-n", "-B", "BUILD=build-dryrun", *args, "all", env=env).replace("\\\n", " ")
    compiles = [ln for ln in out.splitlines() if " -c " in ln and ln.split()[0].endswith("cc")]
    links = [ln for ln in out.splitlines()
             if ln.split()[:1] and ln.split()[0].endswith("cc") and " -c " not in ln]
    assert compiles and links, out[:2000]
    return compiles, links


def test_packager_flags_are_honoured_and_no_werror():
    """CPPFLAGS, CFLAGS and LDFLAGS from the command line or the environment reach every compile
    and link line, beside the flags the build needs (C11, -fPIC, the checkout's headers first);
    a plain `make` has no -Werror (a packager's newer compiler may warn), the project's checks
    (WERROR=1, as make test passes) have it."""
    compiles, links = dry_run("CPPFLAGS=-DIDEM_TEST_MARK", "CFLAGS=-O1 -g3",
                              "LDFLAGS=-Wl,-z,relro -Wl,--build-id")
    print(f"{len(compiles)} compile lines, {len(links)} link lines; e.g.\n{compiles[0]}")
    for ln in compiles:
        flags = ln.split()
        assert "-DIDEM_TEST_MARK" in flags, ln
        assert "-O1" in flags and "-g3" in flags, ln
        assert "-std=c11" in flags and "-fPIC" in flags, ln
        assert flags.index("-Iinclude") < flags.index("-DIDEM_TEST_MARK"), ln
        assert "-Werror" not in flags, ln
    for ln in links:
        assert "-Wl,-z,relro" in ln.split() and "-Wl,--build-id" in ln.split(), ln

    env = dict(os.environ, CPPFLAGS="-DIDEM_TEST_MARK_ENV", LDFLAGS="-Wl,--as-needed")
    compiles, links = dry_run(env=env)
    assert all("-DIDEM_TEST_MARK_ENV" in ln.split() for ln in compiles), compiles[0]
    assert all("-Wl,--as-needed" in ln.split() for ln in links), links[0]

    compiles, _ = dry_run("WERROR=1")
    assert all("-Werror" in ln.split() for ln in compiles), compiles[0]
