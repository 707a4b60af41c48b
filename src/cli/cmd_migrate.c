/* cmd_migrate.c - `idem migrate`. */
#include <stdio.h>

#include <idem/idem.h>

#include "args.h"
#include "pg.h"

int cmd_migrate(int argc, char **argv, cli_global_t *g)
{
    const char *dir = NULL;
    const cli_opt_t opts[] = {
        {"--sql-dir", OPT_STRING, &dir, "DIR", "beside the binary, or $IDEM_SQL_DIR",
         "directory of numbered *.sql migrations", 0, 0},
        {0},
    };
    int rc = cli_parse("migrate", "[--sql-dir DIR]", argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    idem_error_t err = {0};
    PGconn *conn = idemp_pg_connect_once(g->pg, &err);
    if (conn == NULL) {
        fprintf(stderr, "idem migrate: %s\n", err.text);
        return CLI_EXIT_FAIL;
    }
    int applied = 0;
    rc = idem_migrate(conn, dir, stdout, &applied, &err);
    idemp_pgconn_close(conn);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem migrate: %s\n", err.text);
        return CLI_EXIT_FAIL;
    }
    return CLI_EXIT_OK;
}
