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

#define MIGRATE_LOCK "SELECT pg_advisory_lock(7650, 1)"
#define MIGRATE_UNLOCK "SELECT pg_advisory_unlock(7650, 1)"
#define MIGRATE_BOOTSTRAP                                                                          \
    "CREATE TABLE IF NOT EXISTS idem_schema_migrations (version text PRIMARY KEY, "                \
    "applied_at timestamptz NOT NULL DEFAULT now())"
#define MIGRATE_APPLIED "SELECT 1 FROM idem_schema_migrations WHERE version = $1"
#define MIGRATE_RECORD "INSERT INTO idem_schema_migrations (version) VALUES ($1)"

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

static int apply_one(PGconn *conn, const char *dir, const char *name, bool *applied,
                     idem_error_t *err)
{
    const char *p[] = {name};
    idemp_rows_t *res;
    *applied = false;
    int rc = idemp_pgconn_exec(conn, MIGRATE_APPLIED, 1, p, &res, err);
    if (rc != IDEM_OK)
        return rc;
    bool done = idemp_rows_count(res) > 0;
    idemp_rows_free(res);
    if (done)
        return IDEM_OK;

    char path[PATH_MAX + 256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *sql = slurp(path);
    if (sql == NULL)
        return idem_error_set(err, IDEM_ERR_IO, "cannot read %s", path);
    rc = idemp_pgconn_exec(conn, "BEGIN", 0, NULL, NULL, err);
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

int idem_migrate(PGconn *conn, const char *sql_dir, FILE *out, int *applied, idem_error_t *err)
{
    char dir[PATH_MAX];
    if (applied != NULL)
        *applied = 0;
    if (sql_dir != NULL)
        snprintf(dir, sizeof dir, "%s", sql_dir);
    else if (!find_sql_dir(dir, sizeof dir))
        return idem_error_set(err, IDEM_ERR_NOT_FOUND,
                              "no sql directory found (set IDEM_SQL_DIR or install idem)");
    DIR *d = opendir(dir);
    if (d == NULL)
        return idem_error_set(err, IDEM_ERR_IO, "cannot open %s", dir);
    char *names[256];
    size_t n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL && n < 256) {
        size_t len = strlen(de->d_name);
        if (len > 4 && de->d_name[0] >= '0' && de->d_name[0] <= '9' &&
            strcmp(de->d_name + len - 4, ".sql") == 0)
            names[n++] = strdup(de->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof names[0], by_name);

    int rc = idemp_pgconn_exec(conn, MIGRATE_LOCK, 0, NULL, NULL, err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, MIGRATE_BOOTSTRAP, 0, NULL, NULL, err);
    int count = 0;
    for (size_t i = 0; i < n && rc == IDEM_OK; i++) {
        bool did;
        rc = names[i] ? apply_one(conn, dir, names[i], &did, err) : IDEM_ERR_NOMEM;
        if (rc == IDEM_OK && did) {
            count++;
            if (out != NULL)
                fprintf(out, "applied %s\n", names[i]);
        }
    }
    if (rc == IDEM_OK && out != NULL && count == 0)
        fprintf(out, "nothing to apply: all %zu migrations already applied\n", n);
    if (idemp_pgconn_ok(conn))
        idemp_pgconn_exec(conn, MIGRATE_UNLOCK, 0, NULL, NULL, NULL);
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    if (applied != NULL)
        *applied = count;
    return rc;
}
