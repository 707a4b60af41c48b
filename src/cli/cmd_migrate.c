/* cmd_migrate.c - `idem migrate`. */
#include <stdbool.h>
#include <stdio.h>

#include <idem/idem.h>

#include "args.h"
#include "pg.h"

int cmd_migrate(int argc, char **argv, cli_global_t *g)
{
    const char *dir = NULL;
    bool billing = false, status = false;
    const cli_opt_t opts[] = {
        {"--billing", OPT_FLAG, &billing, NULL, NULL,
         "also the bundled billing handlers' tables (schema billing)", 0, 0},
        {"--status", OPT_FLAG, &status, NULL, NULL,
         "list applied and pending migrations, apply nothing; exit 1 when some are pending", 0, 0},
        {"--sql-dir", OPT_STRING, &dir, "DIR", "beside the binary, or $IDEM_SQL_DIR",
         "directory of numbered *.sql migrations", 0, 0},
        {0},
    };
    int rc = cli_parse("migrate", "[--billing] [--status] [--sql-dir DIR]", argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    idem_error_t err = {0};
    PGconn *conn = idemp_pg_connect_once(g->pg, &err);
    if (conn == NULL) {
        fprintf(stderr, "idem migrate: %s\n", err.text);
        return CLI_EXIT_FAIL;
    }
    int n = 0, flags = billing ? IDEM_MIGRATE_BILLING : 0;
    rc = status ? idem_migrate_status(conn, dir, flags, stdout, &n, &err)
                : idem_migrate_with(conn, dir, flags, stdout, &n, &err);
    idemp_pgconn_close(conn);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem migrate: %s\n", err.text);
        return CLI_EXIT_FAIL;
    }
    return status && n > 0 ? CLI_EXIT_FAIL : CLI_EXIT_OK;
}
