// The idem operator console. Everything shown comes from the API as JSON and is put on the page
// with textContent and createElement only: event types, errors, details and bodies are written
// by whoever published a message, and are never parsed as HTML.
'use strict';

(function () {
  const REFRESH_MS = 3000;
  const $ = (id) => document.getElementById(id);
  let token = '';
  let config = { queues: [], actions: false, max_age_seconds: 300 };
  let confirming = null; // {key, until}: a discard waiting for its second click
  let busy = false;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function age(s) {
    if (s === null || s === undefined) return '-';
    s = Math.max(0, Math.round(s));
    if (s < 120) return s + 's';
    if (s < 7200) return Math.round(s / 60) + 'm';
    if (s < 172800) return Math.round(s / 3600) + 'h';
    return Math.round(s / 86400) + 'd';
  }

  async function getJSON(path) {
    const r = await fetch(path, { cache: 'no-store', credentials: 'omit' });
    const body = await r.json().catch(() => ({ error: 'HTTP ' + r.status }));
    if (!r.ok) throw new Error(body.error || 'HTTP ' + r.status);
    return body;
  }

  async function act(path, body) {
    const r = await fetch(path, {
      method: 'POST',
      cache: 'no-store',
      credentials: 'omit',
      headers: { 'Content-Type': 'application/json', Authorization: 'Bearer ' + token },
      body: JSON.stringify(body),
    });
    const j = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(j.error || 'HTTP ' + r.status);
    return j;
  }

  function notice(text, bad) {
    const n = $('notice');
    n.textContent = text;
    n.className = bad ? 'notice bad' : 'notice';
    n.hidden = false;
  }

  function sparkline(points, old) {
    const NS = 'http://www.w3.org/2000/svg';
    const svg = document.createElementNS(NS, 'svg');
    svg.setAttribute('viewBox', '0 0 100 24');
    svg.setAttribute('preserveAspectRatio', 'none');
    svg.setAttribute('class', old ? 'spark old' : 'spark');
    if (points.length > 1) {
      const max = Math.max(1, ...points);
      const pl = document.createElementNS(NS, 'polyline');
      pl.setAttribute('points', points.map((v, i) =>
        (i * 100 / (points.length - 1)).toFixed(1) + ',' + (23 - v * 22 / max).toFixed(1)).join(' '));
      svg.appendChild(pl);
    }
    return svg;
  }

  function button(label, cls, action, id, onclick) {
    const b = el('button', label, cls);
    b.type = 'button';
    b.dataset.action = action;
    b.dataset.eventId = id === null || id === undefined ? '' : String(id);
    const can = config.actions && token !== '';
    if (action !== 'show' && !can) {
      b.disabled = true;
      b.title = config.actions ? 'enter the token first' : 'read-only console';
    }
    b.addEventListener('click', onclick);
    return b;
  }

  // labels name the cells for the narrow layout, where each row is a card (console.css)
  function row(cells, labels) {
    const tr = document.createElement('tr');
    cells.forEach((c, i) => {
      if (labels && labels[i]) c.dataset.label = labels[i];
      tr.appendChild(c);
    });
    return tr;
  }

  const BACKLOG = ['Event type', 'Pending', 'Oldest', 'Failed', 'Last minutes'];
  const FAILED = ['Event id', 'Event type', 'Attempts', 'Created', 'Last error', ''];
  const LETTERS = ['Event id', 'Event type', 'Code', 'Detail', 'Age', ''];

  function td(text, cls) { return el('td', text, cls); }

  function renderBacklog(status, history) {
    const tbody = $('backlog').tBodies[0];
    const foot = $('backlog').tFoot;
    tbody.replaceChildren();
    foot.replaceChildren();
    const limit = config.max_age_seconds;
    for (const t of status.event_types) {
      const old = t.oldest_pending_seconds !== null && t.oldest_pending_seconds > limit;
      const spark = td(null);
      spark.appendChild(sparkline(history.map((s) => (s.types[t.event_type] || [0])[0] || 0), old));
      tbody.appendChild(row([td(t.event_type, 'mono'), td(t.pending, 'num'),
        td(age(t.oldest_pending_seconds), old ? 'num old' : 'num'), td(t.failed, 'num'), spark],
        BACKLOG));
    }
    if (status.event_types.length === 0) {
      const c = td('nothing pending, nothing failed', 'empty');
      c.colSpan = 5;
      tbody.appendChild(row([c]));
    }
    const tot = status.totals;
    const spark = td(null);
    spark.appendChild(sparkline(history.map((s) => s.pending || 0), tot.oldest_pending_seconds > limit));
    foot.appendChild(row([td('total'), td(tot.pending, 'num'), td(age(tot.oldest_pending_seconds), 'num'),
      td(tot.failed, 'num'), spark], BACKLOG));
    const banner = $('banner');
    if (tot.oldest_pending_seconds !== null && tot.oldest_pending_seconds > limit) {
      banner.textContent = 'The oldest pending event is ' + age(tot.oldest_pending_seconds) +
        ' old, over the ' + age(limit) + ' threshold: is the relay running?';
      banner.hidden = false;
    } else {
      banner.hidden = true;
    }
  }

  function renderFailed(rows) {
    const tbody = $('failed').tBodies[0];
    tbody.replaceChildren();
    $('failedcount').textContent = String(rows.length);
    for (const r of rows) {
      const actions = td(null, 'actions');
      actions.appendChild(button('Replay', 'primary', 'replay', r.event_id, (ev) => {
        ev.target.disabled = true;
        run(() => act('/api/replay', { event_id: r.event_id }),
          (j) => 'Replayed ' + r.event_id + ': ' + j.replayed + ' row returned to pending');
      }));
      tbody.appendChild(row([td(r.event_id, 'id'), td(r.event_type, 'mono'), td(r.attempts, 'num'),
        td(r.created_at, 'nowrap'), td(r.last_error, 'err'), actions], FAILED));
    }
    if (rows.length === 0) {
      const c = td('no failed rows', 'empty');
      c.colSpan = 6;
      tbody.appendChild(row([c]));
    }
  }

  async function show(queue, id) {
    try {
      const m = await getJSON('/api/dlq/message?queue=' + encodeURIComponent(queue) +
        '&event_id=' + encodeURIComponent(id));
      const text = [
        'queue: ' + queue, 'code: ' + m.code, 'detail: ' + m.detail,
        'age: ' + age(m.age_seconds), 'requeued: ' + m.requeued, 'routing key: ' + m.routing_key,
        '', 'properties: ' + JSON.stringify(m.properties, null, 2),
        '', 'headers: ' + JSON.stringify(m.headers, null, 2),
        '', 'body (' + m.body_bytes + ' bytes' + (m.body_escaped ? ', escaped' : '') + '):',
        m.body === null ? '(not read)' : m.body,
      ].join('\n');
      $('detailid').textContent = String(id);
      $('detailtext').textContent = text;
      $('detail').hidden = false;
      $('detail').scrollIntoView({ block: 'nearest' });
    } catch (e) {
      notice('Cannot show ' + id + ': ' + e.message, true);
    }
  }

  function renderDlq(queue, letters, error) {
    const sec = el('div', null, 'dlq');
    sec.appendChild(el('h3', queue + '.dlq'));
    if (error) {
      sec.appendChild(el('p', 'cannot read: ' + error, 'err'));
      return sec;
    }
    const wrap = el('div', null, 'wrap');
    const table = document.createElement('table');
    table.dataset.queue = queue;
    table.className = 'cards';
    const head = row(LETTERS.map((h) => el('th', h)));
    table.createTHead().appendChild(head);
    const tbody = table.createTBody();
    for (const m of letters) {
      const id = m.event_id;
      const key = queue + '\u0000' + id;
      const actions = td(null, 'actions');
      actions.appendChild(button('Show', '', 'show', id, () => show(queue, id)));
      actions.appendChild(document.createTextNode(' '));
      actions.appendChild(button('Requeue', 'primary', 'requeue', id, (ev) => {
        ev.target.disabled = true;
        run(() => act('/api/dlq/requeue', { queue: queue, event_id: id }),
          (j) => 'Requeued ' + id + ' to ' + queue + ': ' + j.requeued + ' moved');
      }));
      actions.appendChild(document.createTextNode(' '));
      const pending = confirming && confirming.key === key && confirming.until > Date.now();
      actions.appendChild(button(pending ? 'Confirm discard' : 'Discard', pending ? 'confirm' : 'danger',
        pending ? 'confirm-discard' : 'discard', id, (ev) => {
          if (confirming && confirming.key === key && confirming.until > Date.now()) {
            confirming = null;
            ev.target.disabled = true;
            run(() => act('/api/dlq/discard', { queue: queue, event_id: id }),
              (j) => 'Discarded ' + id + ' from ' + queue + '.dlq: ' + j.discarded + ' removed');
          } else {
            confirming = { key: key, until: Date.now() + 8000 };
            ev.target.textContent = 'Confirm discard';
            ev.target.className = 'confirm';
            ev.target.dataset.action = 'confirm-discard';
          }
        }));
      tbody.appendChild(row([td(id, 'id'), td(m.event_type, 'mono'), td(m.code, 'mono'),
        td(m.detail, 'err'), td(age(m.age_seconds), 'num'), actions], LETTERS));
    }
    if (letters.length === 0) {
      const c = td('no dead letters', 'empty');
      c.colSpan = 6;
      tbody.appendChild(row([c]));
    }
    wrap.appendChild(table);
    sec.appendChild(wrap);
    return sec;
  }

  async function run(action, say) {
    busy = true;
    try {
      notice(say(await action()), false);
    } catch (e) {
      notice('Refused: ' + e.message, true);
    } finally {
      busy = false;
      refresh();
    }
  }

  async function refresh() {
    const err = $('error');
    try {
      const [status, history, failed] = await Promise.all(
        [getJSON('/api/status'), getJSON('/api/history'), getJSON('/api/failed')]);
      const dlqs = await Promise.all(config.queues.map((q) =>
        getJSON('/api/dlq?queue=' + encodeURIComponent(q)).then((l) => [q, l, null], (e) => [q, [], e.message])));
      renderBacklog(status, history);
      renderFailed(failed);
      const box = $('dlqs');
      box.replaceChildren(el('h2', 'Dead letters'));
      if (config.queues.length === 0) box.appendChild(el('p', 'no --queue given', 'empty'));
      for (const [q, l, e] of dlqs) box.appendChild(renderDlq(q, l, e));
      err.hidden = true;
      $('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
    } catch (e) {
      err.textContent = 'Cannot refresh: ' + e.message;
      err.hidden = false;
    }
  }

  async function start() {
    // a token may come in the fragment (#token=...), which is never sent to the server
    const m = /^#token=(.+)$/.exec(location.hash);
    if (m) {
      token = decodeURIComponent(m[1]);
      history.replaceState(null, '', location.pathname + location.search);
    }
    const input = $('token');
    input.value = token;
    input.addEventListener('input', () => { token = input.value.trim(); refresh(); });
    $('closedetail').addEventListener('click', () => { $('detail').hidden = true; });
    try {
      config = await getJSON('/api/config');
    } catch (e) {
      $('error').textContent = 'Cannot load the configuration: ' + e.message;
      $('error').hidden = false;
    }
    $('mode').textContent = config.actions
      ? 'Actions (replay, requeue, discard) need the token given to idem console --token-file.'
      : 'Read-only: idem console was started without --token-file.';
    $('tokenbox').hidden = !config.actions;
    await refresh();
    setInterval(() => { if (!busy) refresh(); }, REFRESH_MS);
  }

  document.addEventListener('DOMContentLoaded', start);
})();
