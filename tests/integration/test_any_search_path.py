"""Every statement of idem's binaries names its schema (idem.event_outbox, idem.idem_emit,
billing.dunning, ...): relay, consumer and the one-shot commands work whatever the connection's
search_path is, with nothing on it or with public only (contract, "Database")."""

import json

import pytest

from conftest import Db, finish_daemons, new_id, payload, run_idem, wait_until
from relay_helpers import RelayDaemon, md5_uuid


def with_path(url, path):
    return url + ("&" if "?" in url else "?") + "options=-csearch_path%3D" + path


@pytest.mark.parametrize("path", ["", "public"])
def test_relay_consumer_and_commands_on_a_bare_search_path(db, servers, queue, consumers,
                                                           tmp_path, request, path):
    bare = Db(with_path(db.url, path))
    assert bare.scalar("SELECT current_setting('search_path')") == path
    c = consumers("billing", queue, bare)
    relay = RelayDaemon(bare, servers, str(tmp_path), name="relay")
    try:
        relay.start(wait_ready=True)
        sub, inv = new_id(), new_id()
        ids = []
        for key, typ, body in [(f"pf:{sub}", "payment.failed", payload(subscription_id=sub)),
                               (f"invoice:{inv}:paid", "invoice.paid",
                                payload(subscription_id=sub, invoice_id=inv))]:
            r = run_idem("emit", "--type", typ, "--subscription", sub, "--key", key,
                         "--payload", json.dumps(body), pg_url=bare.url)
            assert r.returncode == 0, r.stderr
            ids.append(r.stdout.strip())
        receipt = md5_uuid(f"idem:{ids[1]}:receipt")
        wait_until(lambda: db.count("billing.receipts") == 1, 20, 0.1, "the receipt applied")
        assert db.ledger() == sorted(("billing", e) for e in ids + [receipt])
        assert db.dunning_step(sub) == 0
        for cmd in (["status"], ["failed"], ["retain"]):
            r = run_idem(*cmd, pg_url=bare.url)
            assert r.returncode == 0, (cmd, r.stderr)
        assert c.stop() == 0
        assert relay.stop() == 0
    finally:
        finish_daemons([relay], request)
