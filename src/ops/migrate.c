/* migrate.c - applies the numbered sql/ files in order, once each, recorded in
 * idem_schema_migrations. */
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <idem/ops.h>

#include "pg.h"

#ifndef IDEM_SQL_DIR_DEFAULT
#define IDEM_SQL_DIR_DEFAULT "/usr/local/share/idem/sql"
#endif

/* One migrate at a time, without an advisory lock (any role that can connect may take one and
 * hold it): each migration's transaction locks idem.idem_migrate_lock, a table that migrate makes
 * before anything else (so on an empty database too) and only idem's owner may lock in a mode
 * that conflicts (a role without privileges can take ACCESS SHARE at most). Every wait, for the
 * lock or in a migration's DDL, is bounded by lock_timeout: the session's, or 60s when it has
 * none. */
#define MIGRATE_TIMEOUT                                                                            \
    "SELECT pg_catalog.set_config('lock_timeout', CASE pg_catalog.current_setting('lock_timeout')" \
    " WHEN '0' THEN '60s' ELSE pg_catalog.current_setting('lock_timeout') END, true)"
#define MIGRATE_LOCK_TABLE "CREATE TABLE IF NOT EXISTS idem.idem_migrate_lock ()"
#define MIGRATE_LOCK "LOCK TABLE idem.idem_migrate_lock IN EXCLUSIVE MODE"
/* Two runs making schema idem or the tables at once on an empty database: the second fails on the
 * catalog's unique index when the first commits, and finds them on its next try. */
#define BOOTSTRAP_TRIES 3
/* The migrations run with a search_path of their own, pg_catalog first and no schema another role
 * can create objects in: a function or operator planted in public (or any schema on the caller's
 * path) cannot run inside them, whoever runs `idem migrate`. */
#define MIGRATE_SEARCH_PATH "SET search_path = pg_catalog, idem, pg_temp"
/* The schemas of the caller's own search_path, read before it is replaced. */
#define MIGRATE_CALLER_PATH "SELECT pg_catalog.current_schemas(false)::text"
/* A database migrated by an older idem: the first schema of the caller's search_path that holds
 * an idem_schema_migrations (as the older idem found it), while schema idem holds none. */
#define MIGRATE_LEGACY                                                                             \
    "SELECT s, pg_catalog.quote_ident(s) FROM pg_catalog.unnest($1::text[]) WITH ORDINALITY "      \
    "AS t(s, i) "                                                                                  \
    "WHERE s <> 'idem' AND pg_catalog.to_regclass('idem.idem_schema_migrations') IS NULL "         \
    "AND pg_catalog.to_regclass(pg_catalog.quote_ident(s) || '.idem_schema_migrations') IS NOT "   \
    "NULL ORDER BY i LIMIT 1"
#define MIGRATE_SCHEMA "CREATE SCHEMA IF NOT EXISTS idem"
/* A schema idem that idem migrate did not make (no tracking table) and another role owns. */
#define MIGRATE_SQUATTED                                                                           \
    "SELECT pg_catalog.pg_get_userbyid(n.nspowner) FROM pg_catalog.pg_namespace n "                \
    "WHERE n.nspname = 'idem' AND n.nspowner <> (SELECT r.oid FROM pg_catalog.pg_roles r "         \
    "WHERE r.rolname = current_user) AND pg_catalog.to_regclass('idem.idem_schema_migrations') "   \
    "IS NULL"
#define MIGRATE_BOOTSTRAP                                                                          \
    "CREATE TABLE IF NOT EXISTS idem.idem_schema_migrations (version text PRIMARY KEY, "           \
    "applied_at timestamptz NOT NULL DEFAULT now())"
#define MIGRATE_LEGACY_MARK "SELECT pg_catalog.set_config('idem.legacy_schema', $1, true)"
#define MIGRATE_APPLIED "SELECT 1 FROM idem.idem_schema_migrations WHERE version = $1"
#define MIGRATE_RECORD "INSERT INTO idem.idem_schema_migrations (version) VALUES ($1)"
/* --status: what is recorded as applied, in idem or (not yet moved) an older idem's schema $1. */
#define STATUS_HAVE_IDEM "SELECT pg_catalog.to_regclass('idem.idem_schema_migrations') IS NOT NULL"
#define STATUS_APPLIED "SELECT version FROM idem.idem_schema_migrations"
/* an older idem's: "SELECT version FROM " + the quoted schema + ".idem_schema_migrations" */
/* The migration that moves an older idem's objects into schema idem (sql/010_schema_idem.sql). */
#define MIGRATE_MOVE_PREFIX "010_"
static bool is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The sql directory: $IDEM_SQL_DIR, then beside the binary (checkout: build/../sql, installed:
 * bin/../share/idem/sql), then the compiled-in install location. */
static bool find_sql_dir(char *out, size_t sz)
{
    const char *env = getenv("IDEM_SQL_DIR");
    if (env != NULL && *env && is_dir(env)) {
        snprintf(out, sz, "%s", env);
        return true;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash != NULL) {
            *slash = '\0';
            static const char *const rel[] = {"/../sql", "/../share/idem/sql"};
            for (size_t i = 0; i < 2; i++) {
                int w = snprintf(out, sz, "%s%s", exe, rel[i]);
                if (w > 0 && (size_t)w < sz && is_dir(out))
                    return true;
            }
        }
    }
    snprintf(out, sz, "%s", IDEM_SQL_DIR_DEFAULT);
    return is_dir(out);
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 16384;
            char *nb = realloc(buf, cap);
            if (nb == NULL) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, 4096, f);
        len += r;
        if (r < 4096)
            break;
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

/* The migrations of dir/sub (sub "" for idem's own, "billing/" for the bundled handlers'), sorted,
 * appended to l as "sub" + file name. */
typedef struct migration_list {
    char *names[256];
    size_t n;
} migration_list_t;

static int list_dir(migration_list_t *l, const char *dir, const char *sub, idem_error_t *err)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    DIR *d = opendir(path);
    if (d == NULL)
        return idem_error_set(err, IDEM_ERR_IO, "cannot open %s", path);
    size_t first = l->n;
    struct dirent *de;
    int rc = IDEM_OK;
    while ((de = readdir(d)) != NULL && rc == IDEM_OK) {
        size_t len = strlen(de->d_name);
        if (len <= 4 || de->d_name[0] < '0' || de->d_name[0] > '9' ||
            strcmp(de->d_name + len - 4, ".sql") != 0)
            continue;
        size_t sz = strlen(sub) + len + 1;
        char *name = l->n < 256 ? malloc(sz) : NULL;
        if (name == NULL) {
            rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory (or over 256 migrations)");
            break;
        }
        snprintf(name, sz, "%s%s", sub, de->d_name);
        l->names[l->n++] = name;
    }
    closedir(d);
    qsort(l->names + first, l->n - first, sizeof l->names[0], by_name);
    return rc;
}

static void list_free(migration_list_t *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->names[i]);
    l->n = 0;
}

/* idem's migrations, then (IDEM_MIGRATE_BILLING) the bundled handlers' from sql/billing/. */
static int list_migrations(const char *sql_dir, int flags, char *dir, size_t dirsz,
                           migration_list_t *l, idem_error_t *err)
{
    l->n = 0;
    if (sql_dir != NULL)
        snprintf(dir, dirsz, "%s", sql_dir);
    else if (!find_sql_dir(dir, dirsz))
        return idem_error_set(err, IDEM_ERR_NOT_FOUND,
                              "no sql directory found (set IDEM_SQL_DIR or install idem)");
    int rc = list_dir(l, dir, "", err);
    if (rc == IDEM_OK && (flags & IDEM_MIGRATE_BILLING))
        rc = list_dir(l, dir, "billing/", err);
    if (rc != IDEM_OK)
        list_free(l);
    return rc;
}

/* The schema of an older idem's objects: its name and its name quoted as an identifier. */
typedef struct legacy {
    char name[128], quoted[140];
} legacy_t;

/* Replaces the session's search_path with idem's own (MIGRATE_SEARCH_PATH) and finds the schema
 * of an older idem's migrations on the caller's search_path (name "" if none). */
static int pin_path(PGconn *conn, legacy_t *legacy, idem_error_t *err)
{
    idemp_rows_t *res = NULL;
    legacy->name[0] = legacy->quoted[0] = '\0';
    int rc = idemp_pgconn_exec(conn, MIGRATE_CALLER_PATH, 0, NULL, &res, err);
    char *path =
        rc == IDEM_OK && idemp_rows_count(res) == 1 ? strdup(idemp_rows_get(res, 0, 0)) : NULL;
    idemp_rows_free(res);
    if (rc == IDEM_OK && path == NULL)
        rc = idem_error_set(err, IDEM_ERR_NOMEM, "out of memory");
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_SEARCH_PATH, 0, NULL, NULL, err);
    if (rc == IDEM_OK) {
        const char *p[] = {path};
        rc = idemp_pgconn_exec(conn, MIGRATE_LEGACY, 1, p, &res, err);
        if (rc == IDEM_OK && idemp_rows_count(res) == 1) {
            snprintf(legacy->name, sizeof legacy->name, "%s", idemp_rows_get(res, 0, 0));
            snprintf(legacy->quoted, sizeof legacy->quoted, "%s", idemp_rows_get(res, 0, 1));
        }
        idemp_rows_free(res);
    }
    free(path);
    return rc;
}

/* Opens a transaction holding the migration lock, its waits bounded (MIGRATE_TIMEOUT). */
static int begin_locked(PGconn *conn, idem_error_t *err)
{
    int rc = idemp_pgconn_exec(conn, "BEGIN", 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_TIMEOUT, 0, NULL, NULL, err);
    if (rc == IDEM_OK) {
        idem_error_t e = {0};
        rc = idemp_pgconn_exec(conn, MIGRATE_LOCK, 0, NULL, NULL, &e);
        if (rc != IDEM_OK && err != NULL && err->code == 0) {
            *err = e;
            snprintf(err->text, sizeof err->text,
                     "waiting for another idem migrate (idem.idem_migrate_lock): %.440s", e.text);
        }
    }
    return rc;
}

/* Applies one migration in a transaction of its own: nothing of a file that fails stays. legacy
 * (non-NULL): the schema of an older idem's objects, for the migration that moves them
 * (idem.legacy_schema); the record of what is applied is then that schema's, moved by it. Whether
 * the file is applied is read under the migration lock: a run that waited for another finds what
 * that one applied (or moved). */
static int apply_one(PGconn *conn, const char *dir, const char *name, const char *legacy,
                     bool *applied, idem_error_t *err)
{
    const char *p[] = {name};
    idemp_rows_t *res = NULL;
    *applied = false;
    char path[PATH_MAX + 256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *sql = slurp(path);
    if (sql == NULL)
        return idem_error_set(err, IDEM_ERR_IO, "cannot read %s", path);
    int rc = begin_locked(conn, err);
    if (rc == IDEM_OK && legacy != NULL) {
        rc = idemp_pgconn_exec(conn, STATUS_HAVE_IDEM, 0, NULL, &res, err);
        if (rc == IDEM_OK && idemp_rows_count(res) == 1 && idemp_rows_get(res, 0, 0)[0] == 't')
            legacy = NULL; /* moved by another run meanwhile */
        idemp_rows_free(res);
        res = NULL;
    }
    bool done = false;
    if (rc == IDEM_OK && legacy == NULL) {
        rc = idemp_pgconn_exec(conn, MIGRATE_APPLIED, 1, p, &res, err);
        done = rc == IDEM_OK && idemp_rows_count(res) > 0;
        idemp_rows_free(res);
    }
    if (rc == IDEM_OK && done) {
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
        free(sql);
        return rc;
    }
    if (rc == IDEM_OK && legacy != NULL) {
        const char *lp[] = {legacy};
        rc = idemp_pgconn_exec(conn, MIGRATE_LEGACY_MARK, 1, lp, NULL, err);
    }
    if (rc == IDEM_OK) {
        /* a migration file is trusted DDL from the package, run as a script */
        char what[300];
        snprintf(what, sizeof what, "migration %s", name);
        rc = idemp_pgconn_script(conn, sql, what, err);
    }
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_RECORD, 1, p, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
    if (rc != IDEM_OK && idemp_pgconn_ok(conn))
        idemp_pgconn_exec(conn, "ROLLBACK", 0, NULL, NULL, NULL);
    free(sql);
    *applied = rc == IDEM_OK;
    return rc;
}

/* Schema idem and its record of applied migrations; a schema idem that another role made before
 * idem did is refused (its owner could plant objects on idem's search_path). With legacy, the
 * record is the older idem's, which the move migration brings along. */
static int bootstrap_once(PGconn *conn, bool legacy, idem_error_t *err)
{
    int rc = idemp_pgconn_exec(conn, "BEGIN", 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_TIMEOUT, 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_SCHEMA, 0, NULL, NULL, err);
    idemp_rows_t *res = NULL;
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_SQUATTED, 0, NULL, &res, err);
    if (rc == IDEM_OK && idemp_rows_count(res) == 1)
        rc = idem_error_set(err, IDEM_ERR_REFUSED,
                            "schema idem exists, owned by role %s, and holds no idem migrations: "
                            "drop it, or run idem migrate as that role",
                            idemp_rows_get(res, 0, 0));
    idemp_rows_free(res);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_LOCK_TABLE, 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_LOCK, 0, NULL, NULL, err);
    if (rc == IDEM_OK && !legacy)
        rc = idemp_pgconn_exec(conn, MIGRATE_BOOTSTRAP, 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, err);
    if (rc != IDEM_OK && idemp_pgconn_ok(conn))
        idemp_pgconn_exec(conn, "ROLLBACK", 0, NULL, NULL, NULL);
    return rc;
}

/* A duplicate in the catalog: another run made the schema or a table at the same time. */
static bool made_meanwhile(const idem_error_t *e)
{
    return strcmp(e->sqlstate, "23505") == 0 || strcmp(e->sqlstate, "42P06") == 0 ||
           strcmp(e->sqlstate, "42P07") == 0;
}

static int bootstrap(PGconn *conn, bool legacy, idem_error_t *err)
{
    for (int i = 1;; i++) {
        idem_error_t e = {0};
        int rc = bootstrap_once(conn, legacy, &e);
        if (rc == IDEM_OK || i == BOOTSTRAP_TRIES || !made_meanwhile(&e)) {
            if (rc != IDEM_OK && err != NULL && err->code == 0)
                *err = e;
            return rc;
        }
    }
}

int idem_migrate_with(PGconn *conn, const char *sql_dir, int flags, FILE *out, int *applied,
                      idem_error_t *err)
{
    char dir[PATH_MAX];
    legacy_t legacy;
    migration_list_t l;
    if (applied != NULL)
        *applied = 0;
    int rc = list_migrations(sql_dir, flags, dir, sizeof dir, &l, err);
    if (rc != IDEM_OK)
        return rc;
    rc = pin_path(conn, &legacy, err);
    if (rc == IDEM_OK)
        rc = bootstrap(conn, legacy.name[0] != '\0', err);
    int count = 0;
    /* an older idem's objects move first, so that every later migration finds them in idem */
    for (size_t i = 0; i < l.n && rc == IDEM_OK && legacy.name[0]; i++) {
        bool did = false;
        if (strncmp(l.names[i], MIGRATE_MOVE_PREFIX, strlen(MIGRATE_MOVE_PREFIX)) != 0)
            continue;
        rc = apply_one(conn, dir, l.names[i], legacy.name, &did, err);
        if (rc == IDEM_OK && out != NULL)
            fprintf(out, "applied %s (moved idem's objects from schema %s)\n", l.names[i],
                    legacy.name);
        count += did;
        legacy.name[0] = '\0';
    }
    if (rc == IDEM_OK && legacy.name[0])
        rc = idem_error_set(err, IDEM_ERR_NOT_FOUND, "no %s*.sql migration in %s",
                            MIGRATE_MOVE_PREFIX, dir);
    for (size_t i = 0; i < l.n && rc == IDEM_OK; i++) {
        bool did;
        rc = apply_one(conn, dir, l.names[i], NULL, &did, err);
        if (rc == IDEM_OK && did) {
            count++;
            if (out != NULL)
                fprintf(out, "applied %s\n", l.names[i]);
        }
    }
    if (rc == IDEM_OK && out != NULL && count == 0)
        fprintf(out, "nothing to apply: all %zu migrations already applied\n", l.n);
    list_free(&l);
    if (applied != NULL)
        *applied = count;
    return rc;
}

int idem_migrate(PGconn *conn, const char *sql_dir, FILE *out, int *applied, idem_error_t *err)
{
    return idem_migrate_with(conn, sql_dir, 0, out, applied, err);
}

/* Is name among the versions of res? */
static bool recorded(const idemp_rows_t *res, const char *name)
{
    for (int i = 0; res != NULL && i < idemp_rows_count(res); i++)
        if (strcmp(idemp_rows_get(res, i, 0), name) == 0)
            return true;
    return false;
}

int idem_migrate_status(PGconn *conn, const char *sql_dir, int flags, FILE *out, int *pending,
                        idem_error_t *err)
{
    char dir[PATH_MAX], sql[200];
    legacy_t legacy;
    migration_list_t l;
    *pending = 0;
    int rc = list_migrations(sql_dir, flags, dir, sizeof dir, &l, err);
    if (rc != IDEM_OK)
        return rc;
    rc = pin_path(conn, &legacy, err);
    idemp_rows_t *res = NULL;
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, STATUS_HAVE_IDEM, 0, NULL, &res, err);
    bool have = rc == IDEM_OK && idemp_rows_count(res) == 1 && idemp_rows_get(res, 0, 0)[0] == 't';
    idemp_rows_free(res);
    res = NULL;
    if (rc == IDEM_OK && (have || legacy.name[0])) {
        snprintf(sql, sizeof sql, "SELECT version FROM %s.idem_schema_migrations", legacy.quoted);
        rc = idemp_pgconn_exec(conn, have ? STATUS_APPLIED : sql, 0, NULL, &res, err);
    }
    for (size_t i = 0; i < l.n && rc == IDEM_OK; i++) {
        bool done = recorded(res, l.names[i]);
        *pending += !done;
        if (out != NULL)
            fprintf(out, "%s %s\n", done ? "applied" : "pending", l.names[i]);
    }
    idemp_rows_free(res);
    list_free(&l);
    return rc;
}
