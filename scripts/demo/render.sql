-- Renders the psql script of one workload session (psql variable :session) from demo.ops.
-- Every business operation is one real transaction: the business change and idem_emit commit
-- together or not at all. The demo's progress counter (demo.progress) is bumped in the same
-- transaction, so that one snapshot shows how many operations committed and what they queued.
-- The script paces itself: it sleeps until each 100 ms tick is due.
-- Run with: psql -XAtq -v session=N -f render.sql
SELECT E'\\set ON_ERROR_STOP 1\nSELECT clock_timestamp() AS t0 \\gset';
SELECT format(E'SELECT pg_sleep_until(:''t0''::timestamptz + interval ''100 ms'' * %s);\n%s',
              tick, string_agg(stmt, E'\n' ORDER BY op_id))
FROM (
    SELECT op_id, tick,
           CASE kind
           WHEN 'pay' THEN format(
E'BEGIN;\n'
 'UPDATE invoices SET status = ''paid'', paid_at = now() WHERE invoice_id = ''%1$s'' AND status <> ''paid'';\n'
 'SELECT idem.idem_emit(''invoice.paid'', subscription_id, invoice_id || '':paid'', payload)'
 ' FROM invoice_events WHERE invoice_id = ''%1$s'';\n'
 'UPDATE demo.progress SET ops = ops + 1 WHERE session = %2$s;\n'
 'COMMIT;', invoice_id, :session)
           ELSE format(
E'BEGIN;\n'
 'UPDATE invoices SET status = ''failed'', failed_attempts = GREATEST(failed_attempts, %2$s)'
 ' WHERE invoice_id = ''%1$s'' AND status <> ''paid'';\n'
 'SELECT idem.idem_emit(''payment.failed'', subscription_id, invoice_id || '':failed:%2$s'','
 ' payload || ''{"attempt_no": %2$s}'') FROM invoice_events WHERE invoice_id = ''%1$s'';\n'
 'UPDATE demo.progress SET ops = ops + 1 WHERE session = %3$s;\n'
 'COMMIT;', invoice_id, attempt_no, :session)
           END AS stmt
    FROM demo.ops WHERE session = :session
) s
GROUP BY tick
ORDER BY tick;
