/* main.c - `idem [GLOBAL FLAGS] COMMAND [FLAGS]`: finds the command and hands it the rest. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

#include <idem/idem.h>

#include "args.h"

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv, cli_global_t *g);
    const char *summary;
} command_t;

static const command_t commands[] = {
    {"migrate", cmd_migrate, "apply the sql/ migrations in order, idempotently"},
    {"consume", cmd_consume, "run an exactly-once consumer (daemon)"},
    {"relay", cmd_relay, "publish pending outbox rows with confirms (daemon, or --once)"},
    {"emit", cmd_emit, "queue one event through idem_emit in its own transaction"},
    {"status", cmd_status, "backlog health: pending, failed, consumers, queues, why rows wait"},
    {"failed", cmd_failed, "list failed (parked) outbox rows"},
    {"replay", cmd_replay, "return failed rows to pending"},
    {"retain", cmd_retain, "delete old sent outbox rows and old ledger rows in batches"},
    {"console", cmd_console,
     "the operator console: a web page of the backlog, failed rows and "
     "dead letters, with actions"},
    {"dlq", cmd_dlq, "a consumer's dead-lettered messages (dlq list|show|discard|requeue)"},
    {NULL, NULL, NULL},
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: idem [GLOBAL FLAGS] COMMAND [FLAGS]\n\n"
            "idem %s - billing events applied exactly once in effect, on PostgreSQL and "
            "RabbitMQ\n\ncommands:\n",
            IDEM_VERSION);
    for (const command_t *c = commands; c->name; c++)
        fprintf(f, "  %-9s %s\n", c->name, c->summary);
    fprintf(f, "\nglobal flags (also accepted after the command):\n"
               "  --pg CONNINFO          PostgreSQL conninfo or URI (env IDEM_PG_URL; empty = "
               "libpq PG* defaults)\n"
               "  --amqp URL             RabbitMQ URL (env IDEM_AMQP_URL; default "
               "amqp://guest:guest@127.0.0.1:5672)\n"
               "  --exchange NAME        topic exchange (env IDEM_EXCHANGE; default "
               "billing.events)\n"
               "  --amqp-password-file PATH\n"
               "                         RabbitMQ password, one line (env "
               "IDEM_AMQP_PASSWORD_FILE; overrides the URL's)\n"
               "  --log-level LEVEL      debug|info|warn|error (default info)\n"
               "  --log-format FORMAT    text|json (default text)\n"
               "\n  --version              print 'idem VERSION' and exit\n"
               "\n'idem COMMAND --help' lists every flag of a command with its default.\n"
               "Exit status: 0 success, 1 runtime failure, 2 usage error; status also 1 = "
               "threshold exceeded, 3 = database unreachable, 4 = RabbitMQ "
               "unreachable (--queue).\n");
}

static int takes_value(const char *arg)
{
    static const char *const with_value[] = {"--pg",        "--amqp",       "--exchange",
                                             "--log-level", "--log-format", "--amqp-password-file"};
    for (size_t i = 0; i < sizeof with_value / sizeof with_value[0]; i++)
        if (strcmp(arg, with_value[i]) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    /* no core file, and no ptrace by the same user, may read a password out of this process */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    cli_prescan_format(argc, argv);
    int cmd_at = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return CLI_EXIT_OK;
        }
        if (strcmp(argv[i], "--version") == 0) {
            printf("idem %s\n", IDEM_VERSION);
            return CLI_EXIT_OK;
        }
        if (strncmp(argv[i], "--", 2) != 0) {
            cmd_at = i;
            break;
        }
        if (strchr(argv[i], '=') == NULL && takes_value(argv[i]))
            i++;
    }
    if (cmd_at < 0) {
        cli_error(NULL, "no command given (see 'idem --help')");
        return CLI_EXIT_USAGE;
    }
    const command_t *cmd = NULL;
    for (const command_t *c = commands; c->name; c++)
        if (strcmp(c->name, argv[cmd_at]) == 0)
            cmd = c;
    if (cmd == NULL) {
        cli_error(NULL, "unknown command '%s' (see 'idem --help')", argv[cmd_at]);
        return CLI_EXIT_USAGE;
    }
    /* the command sees: its name, its subcommand (`dlq list`) when one follows, then every other
     * argument in order (global flags may come first: `idem --amqp URL dlq list`) */
    char **args = calloc((size_t)argc + 1, sizeof *args);
    if (args == NULL)
        return CLI_EXIT_FAIL;
    int n = 0, sub_at = cmd_at + 1 < argc && argv[cmd_at + 1][0] != '-' ? cmd_at + 1 : -1;
    args[n++] = argv[cmd_at];
    if (sub_at > 0)
        args[n++] = argv[sub_at];
    for (int i = 1; i < argc; i++)
        if (i != cmd_at && i != sub_at)
            args[n++] = argv[i];
    cli_global_t g;
    cli_global_init(&g);
    int rc = cmd->run(n, args, &g);
    free(args);
    return rc;
}
