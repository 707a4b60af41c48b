"""Helpers shared by the consumer fault-path tests: small C programs built against the library,
failure injection with triggers, and reading a consumer's log and memory."""

import os
import re
import subprocess

from conftest import IDEM, REPO

PROGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progs")
BUILD = os.path.dirname(os.path.abspath(IDEM))  # build/ (or the build dir of IDEM_BIN)


def build_prog(name, out_dir):
    """Compiles tests/integration/progs/NAME.c against the built libidem.so; returns its path."""
    src = os.path.join(PROGS, name + ".c")
    out = os.path.join(str(out_dir), name)
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "libpq", "jansson"],
                           capture_output=True, text=True, check=True).stdout.split()
    cmd = ["cc", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-D_DEFAULT_SOURCE", "-Wall",
           "-I" + os.path.join(REPO, "include"), src, os.path.join(BUILD, "libidem.so"), *flags,
           "-Wl,-rpath," + BUILD, "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stderr}"
    return out


def as_program(consumer, argv):
    """Turns a Consumer made with consumers(..., start=False) into a run of another program
    (argv); the metrics helpers keep working if the program serves consumer.metrics_port."""
    consumer.argv = list(argv)
    return consumer


TRIGGER = """
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF {condition} THEN
        RAISE EXCEPTION '{name}: injected by the test' USING ERRCODE = '{code}';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER {name} BEFORE {events} ON {table} FOR EACH ROW EXECUTE FUNCTION {name}();
"""


def add_failure(db, table, code, name="it_fail", condition="true", events="INSERT OR UPDATE"):
    """A trigger on table raising SQLSTATE code when condition (PL/pgSQL, NEW in scope) holds."""
    db.execute(TRIGGER.format(name=name, condition=condition, code=code, table=table,
                              events=events))


def drop_failure(db, table, name="it_fail"):
    db.execute(f"DROP TRIGGER {name} ON {table}; DROP FUNCTION {name}()")


def log_lines(consumer, pattern):
    """Lines of the consumer's log matching the regular expression."""
    rx = re.compile(pattern)
    return [line for line in consumer.log().splitlines() if rx.search(line)]


def vm_hwm_kib(pid):
    """Peak resident set size (VmHWM) of a running process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")
