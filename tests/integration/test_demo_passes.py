"""`make demo`, the README's first command, runs its billing scenario with crashes on private
servers of its own and passes its exactly-once audit (scripts/demo.py, exit 0)."""

import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.cluster  # starts PostgreSQL and RabbitMQ of its own: about a minute
def test_demo_passes_its_audit(tmp_path):
    # not the suite's servers: the demo starts its own, on ports of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEM_")}
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--out",
                        str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "PASS: every event took effect exactly once" in r.stdout, r.stdout[-4000:]
    assert "FAIL" not in r.stdout, r.stdout[-4000:]
    assert os.path.exists(os.path.join(str(tmp_path), "timeline.svg"))
