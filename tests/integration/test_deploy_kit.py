"""The deployment kit that `make install` puts under share/idem/: systemd units that
systemd-analyze accepts, environment file examples without secrets, and a man page that renders
without warnings and documents every command and every flag that `idem COMMAND --help` prints.
No servers needed."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import IDEM
from install_helpers import idem_version, make_install, require_default_build

UNITS = ("idem-relay.service", "idem-consume@.service")


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """`make install PREFIX=<tmp>` (no DESTDIR), so that the units' ExecStart= names a binary
    that exists, as systemd-analyze verify requires."""
    require_default_build()
    return make_install("", str(tmp_path_factory.mktemp("prefix")))


def unit_settings(path):
    """{(section, key): [values]} of a unit file (keys may repeat)."""
    out, section = {}, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            out.setdefault((section, key.strip()), []).append(value.strip())
    return out


def test_systemd_analyze_verify(kit):
    sa = shutil.which("systemd-analyze")
    assert sa is not None, "systemd-analyze is missing (Debian package systemd): scripts/deps.sh"
    unitdir = kit.path("share", "idem", "systemd")
    # the template is verified through an instance; Documentation=man:idem(1) is checked
    # against the installed man page
    env = dict(os.environ, MANPATH=kit.path("share", "man"), SYSTEMD_LOG_COLOR="0")
    r = subprocess.run([sa, "verify", os.path.join(unitdir, "idem-relay.service"),
                        os.path.join(unitdir, "idem-consume@billing.service")],
                       capture_output=True, text=True, env=env, timeout=60)
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if "idem" in ln]
    assert r.returncode == 0 and ours == [], f"systemd-analyze verify:\n{r.stdout}{r.stderr}"


def test_units_run_the_installed_binary_with_the_contracts_stop_semantics(kit):
    unitdir = kit.path("share", "idem", "systemd")
    relay = unit_settings(os.path.join(unitdir, "idem-relay.service"))
    consume = unit_settings(os.path.join(unitdir, "idem-consume@.service"))
    assert relay[("Service", "ExecStart")] == [f"{kit.bin} relay $IDEM_RELAY_FLAGS"]
    assert consume[("Service", "ExecStart")] == [
        f"{kit.bin} consume --consumer %i $IDEM_CONSUME_FLAGS"]
    assert relay[("Service", "EnvironmentFile")][0] == "/etc/idem/idem.env"
    assert consume[("Service", "EnvironmentFile")] == ["/etc/idem/idem.env",
                                                       "/etc/idem/consume-%i.env"]
    for unit in (relay, consume):
        svc = {k: v[-1] for (section, k), v in unit.items() if section == "Service"}
        assert svc["Restart"] == "on-failure"
        assert svc["KillSignal"] == "SIGTERM"
        assert re.fullmatch(r"\d+s", svc["TimeoutStopSec"])
        assert svc["User"] == "idem" and svc["Group"] == "idem"
        assert svc["NoNewPrivileges"] == "yes"
        assert svc["ProtectSystem"] == "strict"
        assert svc["RestartPreventExitStatus"] == "2"  # a usage error does not heal by restarting
        assert unit[("Unit", "Documentation")] == ["man:idem(1)"]
    with open(os.path.join(unitdir, "idem.sysusers.conf")) as f:
        assert re.search(r"^u idem ", f.read(), re.M)


def env_file(path):
    """{KEY: value} of a systemd EnvironmentFile."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path}: bad line {line!r}"
            out[key] = value
    return out


def help_flags(*cmd):
    """The flags `idem CMD... --help` lists, split into (command flags, global flags)."""
    r = subprocess.run([IDEM, *cmd, "--help"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, f"idem {' '.join(cmd)} --help: exit {r.returncode}: {r.stderr}"
    own, glob = set(), set()
    section = own
    for line in r.stdout.splitlines():
        if line.startswith("global flags"):
            section = glob
        elif line and not line.startswith(" "):
            section = own
        m = re.match(r"^\s+(--[a-z][a-z0-9-]*)", line)
        if m:
            section.add(m.group(1))
    return own, glob, r.stdout


def test_environment_examples_hold_no_secrets_and_valid_flags(kit):
    envdir = kit.path("share", "idem", "env")
    common = env_file(os.path.join(envdir, "idem.env.example"))
    assert {"IDEM_PG_URL", "IDEM_AMQP_URL", "IDEM_AMQP_PASSWORD_FILE"} <= set(common)
    for name in sorted(os.listdir(envdir)):
        values = env_file(os.path.join(envdir, name))
        for key, value in values.items():
            assert not re.search(r"://[^/@\s]*:[^/@\s]*@", value), f"{name}: password in {key}"
            assert "PASSWORD" not in key or key.endswith("_FILE"), f"{name}: {key}"
            assert "password=" not in value, f"{name}: password in {key}"
    # the flags the units pass through exist
    for name, var, cmd in (("relay.env.example", "IDEM_RELAY_FLAGS", "relay"),
                           ("consume-billing.env.example", "IDEM_CONSUME_FLAGS", "consume")):
        flags = env_file(os.path.join(envdir, name))[var].split()
        own, glob, _ = help_flags(cmd)
        unknown = [f for f in flags if f.startswith("--") and f not in own | glob]
        assert unknown == [], f"{name}: flags that `idem {cmd}` does not have"
    consume = env_file(os.path.join(envdir, "consume-billing.env.example"))
    assert "--queue" in consume["IDEM_CONSUME_FLAGS"].split()


def man_sections(path):
    """{title: text} of the man page's .SH and .SS sections, roff escapes removed."""
    with open(path) as f:
        src = f.read()
    src = src.replace("\\-", "-").replace("\\&", "").replace("\\e", "\\")
    src = re.sub(r"\\f[BIRP]", "", src)
    out, title = {}, ""
    for line in src.splitlines():
        m = re.match(r'^\.(SH|SS)\s+"?(.*?)"?\s*$', line)
        if m:
            title = m.group(2)
            out.setdefault(title, "")
            continue
        out[title] = out.get(title, "") + line + "\n"
    return out


def mentions(text, flag):
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def test_man_page_renders_without_warnings(kit):
    page = kit.path("share", "man", "man1", "idem.1")
    with open(page) as f, open(kit.path("share", "idem", "idem.1")) as g:
        text = f.read()
        assert text == g.read()
    assert re.search(rf'^\.TH IDEM 1 .*"idem {re.escape(idem_version())}"', text, re.M)
    groff = shutil.which("groff")
    assert groff is not None, "groff is missing (Debian package groff-base): scripts/deps.sh"
    r = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z", page], capture_output=True,
                       text=True, timeout=30)
    assert (r.returncode, r.stderr) == (0, ""), f"groff warnings:\n{r.stderr}"
    man = shutil.which("man")
    assert man is not None, "man is missing (Debian package man-db): scripts/deps.sh"
    r = subprocess.run([man, "--warnings", "-l", page], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, MANPAGER="cat", PAGER="cat",
                                            MANWIDTH="80"))
    assert r.returncode == 0 and r.stderr == "", f"man -l:\n{r.stderr}"
    assert "idem migrate" in r.stdout and "EXIT STATUS" in r.stdout


def test_man_page_documents_every_command_and_flag(kit):
    sections = man_sections(kit.path("share", "man", "man1", "idem.1"))
    r = subprocess.run([IDEM, "--help"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0
    top = r.stdout
    commands = re.findall(r"^  ([a-z][a-z-]*)\s{2,}\S", top.split("commands:", 1)[1].split("\n\n")[0],
                          re.M)
    assert "consume" in commands and "relay" in commands, top
    _, top_global, _ = help_flags()
    top_flags = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", top, re.M))
    global_text = sections.get("GLOBAL OPTIONS", "")
    for flag in sorted(top_flags | top_global):
        assert mentions(global_text, flag), f"GLOBAL OPTIONS of idem.1 lacks {flag}"

    missing = []
    for cmd in commands:
        own_text = "".join(text for title, text in sections.items()
                           if re.match(rf"idem {re.escape(cmd)}(\s|$)", title))
        if not own_text:
            missing.append(f"a section 'idem {cmd} ...'")
            continue
        own, glob, out = help_flags(cmd)
        # a command with subcommands (`idem dlq list|requeue`) names them in its usage lines
        usage = " ".join(ln for ln in out.splitlines() if ln.startswith("usage:"))
        after = usage.split(f" {cmd} ", 1)[1] if f" {cmd} " in usage else ""
        subs = [w for w in re.findall(r"(?<![\w-])([a-z][a-z]+)(?![\w-])",
                                      re.sub(r"--[\w-]+", " ", after))]
        for sub in subs:
            s_own, s_glob, _ = help_flags(cmd, sub)
            own |= s_own
            glob |= s_glob
        for flag in sorted(own):
            if not mentions(own_text, flag):
                missing.append(f"idem {cmd} {flag}")
        for flag in sorted(glob):
            if not mentions(global_text, flag):
                missing.append(f"global {flag} (from idem {cmd} --help)")
    assert missing == [], "idem.1 does not document: " + ", ".join(missing)


def test_units_wait_for_readiness_and_reload_with_sighup(kit):
    """Type=notify: systemd counts a daemon as started once it says READY=1 (connected and
    serving), and `systemctl reload` sends SIGHUP (re-read the password file, the daemon goes on);
    the hardening stays."""
    unitdir = kit.path("share", "idem", "systemd")
    for name in UNITS:
        unit = unit_settings(os.path.join(unitdir, name))
        svc = {k: v[-1] for (section, k), v in unit.items() if section == "Service"}
        assert svc["Type"] == "notify", name
        assert svc.get("NotifyAccess", "main") == "main", name
        assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID", name
        assert re.fullmatch(r"\d+(s|min)", svc["TimeoutStartSec"]), name
        assert svc["LimitCORE"] == "0", name
        assert "AF_UNIX" in svc["RestrictAddressFamilies"].split(), name  # $NOTIFY_SOCKET
