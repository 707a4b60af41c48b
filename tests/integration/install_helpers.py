"""Helpers for the packaging tests (test_install_layout, test_deploy_kit,
test_examples_build_and_run): `make install` into a temporary tree, pkg-config pointed into it,
compiling a program with pkg-config alone.

These tests install the default build (build/, what `make` and `make test` build). When IDEM_BIN
names another binary (`make sanitize` runs build-san/idem) they are skipped.
"""

import os
import re
import subprocess

import pytest

from conftest import IDEM, REPO


def idem_version():
    """IDEM_VERSION from include/idem/idem.h, the one place the version is written."""
    with open(os.path.join(REPO, "include", "idem", "idem.h")) as f:
        m = re.search(r'^#define IDEM_VERSION "([^"]+)"', f.read(), re.M)
    assert m, "include/idem/idem.h defines no IDEM_VERSION"
    return m.group(1)


def require_default_build():
    if os.path.realpath(IDEM) != os.path.realpath(os.path.join(REPO, "build", "idem")):
        pytest.skip(f"packaging tests install the default build (build/), not {IDEM}")


class Installed:
    """A `make install DESTDIR=destdir PREFIX=prefix` tree."""

    def __init__(self, destdir, prefix):
        self.destdir = destdir
        self.prefix = prefix
        self.root = destdir + prefix if destdir else prefix
        self.links = []  # the sysroot's symlinks to the host, removed by cleanup()

    def path(self, *rel):
        return os.path.join(self.root, *rel)

    @property
    def bin(self):
        return self.path("bin", "idem")

    @property
    def libdir(self):
        return self.path("lib")

    def files(self):
        """Every installed file and symlink, as paths relative to PREFIX."""
        out = set()
        for d, dirs, files in os.walk(self.root):
            for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                out.add(os.path.relpath(os.path.join(d, name), self.root))
        return out

    def pkg_env(self):
        """The environment that points pkg-config at the installed idem.pc.

        With DESTDIR, idem.pc names PREFIX (/usr/local), not where the files are now: the staging
        directory is a sysroot, so PKG_CONFIG_SYSROOT_DIR points at it. pkg-config prefixes every
        package's -I and -L paths with the sysroot, libpq's and jansson's too, so the sysroot also
        sees the host's /usr/include and /usr/lib (symlinks), as a cross build's sysroot would."""
        env = dict(os.environ)
        env["PKG_CONFIG_PATH"] = self.path("lib", "pkgconfig")
        if self.destdir:
            env["PKG_CONFIG_SYSROOT_DIR"] = self.destdir
            for d in ("usr/include", "usr/lib"):
                link = os.path.join(self.destdir, d)
                if not os.path.lexists(link) and not self.prefix.startswith("/" + d):
                    os.makedirs(os.path.dirname(link), exist_ok=True)
                    os.symlink("/" + d, link)
                    self.links.append(link)
        return env

    def cleanup(self):
        for link in self.links:
            os.unlink(link)
        self.links = []

    def run_env(self, base=None):
        """An environment whose dynamic loader finds the installed libidem.so.0 first."""
        env = dict(base if base is not None else os.environ)
        env["LD_LIBRARY_PATH"] = self.libdir
        return env

    def pkg_config(self, *args):
        r = subprocess.run(["pkg-config", *args], capture_output=True, text=True,
                           env=self.pkg_env(), timeout=30)
        assert r.returncode == 0, f"pkg-config {' '.join(args)} failed: {r.stderr}"
        return r.stdout.strip()

    def cc(self, src, out, extra_flags=""):
        """Compiles and links src exactly as documented, `cc SRC $(pkg-config --cflags --libs
        idem)` (plus extra_flags); returns the CompletedProcess."""
        cmd = f'cc {extra_flags} "$1" $(pkg-config --cflags --libs idem) -o "$2"'
        return subprocess.run(["sh", "-c", cmd, "sh", src, out], capture_output=True, text=True,
                              env=self.pkg_env(), timeout=120)


def make_install(destdir, prefix):
    """Runs `make install DESTDIR=destdir PREFIX=prefix` in the checkout; returns Installed."""
    args = ["make", "-s", "--no-print-directory", "-C", REPO, "install", f"PREFIX={prefix}"]
    if destdir:
        args.append(f"DESTDIR={destdir}")
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}{r.stderr}"
    return Installed(destdir, prefix)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """`make install DESTDIR=<tmp> PREFIX=/usr/local`, as a packager would run it."""
    require_default_build()
    inst = make_install(str(tmp_path_factory.mktemp("destdir")), "/usr/local")
    yield inst
    inst.cleanup()


__all__ = ["idem_version", "require_default_build", "Installed", "make_install", "staged"]
