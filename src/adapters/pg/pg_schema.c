/* pg_schema.c - is the database migrated to what this binary needs? Every daemon and one-shot
 * command asks at start: the migrations it needs must be recorded in idem.idem_schema_migrations
 * (sql/), or it says in one line to run idem migrate. */
#include <string.h>

#include "pg.h"

#define SCHEMA_EXISTS "SELECT pg_catalog.to_regnamespace('idem') IS NOT NULL"
/* The first of $1 that is not applied. Qualified throughout: the caller's search_path decides
 * nothing here. */
#define SCHEMA_MISSING                                                                             \
    "SELECT v FROM pg_catalog.unnest($1::text[]) WITH ORDINALITY AS t(v, i) WHERE NOT EXISTS "     \
    "(SELECT 1 FROM idem.idem_schema_migrations m WHERE m.version OPERATOR(pg_catalog.=) t.v) "    \
    "ORDER BY t.i LIMIT 1"

static int not_migrated(const char *what, const char *version, idem_error_t *err)
{
    bool billing = strncmp(version, "billing/", 8) == 0;
    return idem_error_set(err, IDEM_ERR_NOT_FOUND,
                          "the database is not migrated for this version of idem (%s%s is not "
                          "applied%s): run idem migrate%s",
                          what, version, billing ? ": the bundled billing handlers' tables" : "",
                          billing ? " --billing" : "");
}

int idemp_pg_schema_check(PGconn *conn, const char *const *extra, idem_error_t *err)
{
    idemp_rows_t *res = NULL;
    int rc = idemp_pgconn_exec(conn, SCHEMA_EXISTS, 0, NULL, &res, err);
    bool have = rc == IDEM_OK && idemp_rows_count(res) == 1 && idemp_rows_get(res, 0, 0)[0] == 't';
    idemp_rows_free(res);
    if (rc != IDEM_OK)
        return rc;
    if (!have)
        return not_migrated("schema idem is missing, migration ", IDEMP_SCHEMA_NEEDS, err);

    idemp_pgarray_t want;
    idemp_pgarray_init(&want);
    idemp_pgarray_add(&want, IDEMP_SCHEMA_NEEDS);
    idemp_pgarray_add(&want, IDEMP_SCHEMA_NEEDS_ALSO);
    for (size_t i = 0; extra != NULL && extra[i] != NULL; i++)
        idemp_pgarray_add(&want, extra[i]);
    const char *p[] = {idemp_pgarray_str(&want)};
    idem_error_t e = {0};
    rc = p[0] != NULL ? idemp_pgconn_exec(conn, SCHEMA_MISSING, 1, p, &res, &e)
                      : idem_error_set(&e, IDEM_ERR_NOMEM, "out of memory");
    if (rc == IDEM_OK && idemp_rows_count(res) == 1)
        rc = not_migrated("migration ", idemp_rows_get(res, 0, 0), err);
    else if (rc != IDEM_OK && strcmp(e.sqlstate, "42P01") == 0)
        rc = not_migrated("no idem.idem_schema_migrations, migration ", IDEMP_SCHEMA_NEEDS, err);
    else if (rc != IDEM_OK && strcmp(e.sqlstate, "42501") == 0)
        rc = idem_error_set(err, IDEM_ERR_REFUSED,
                            "cannot read which migrations are applied (%s): the role needs one "
                            "of idem's roles (idem_emitter, idem_relay, idem_consumer, "
                            "idem_operator)",
                            e.text);
    else if (rc != IDEM_OK)
        idem_error_set(err, rc, "%s", e.text);
    idemp_rows_free(res);
    idemp_pgarray_free(&want);
    return rc;
}
