/* args.h - the CLI's flag parser: global flags anywhere, per-command tables, help with
 * defaults, one-line usage errors (exit 2). */
#ifndef IDEM_CLI_ARGS_H
#define IDEM_CLI_ARGS_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <idem/error.h>
#include <idem/log.h>

#define CLI_EXIT_OK 0
#define CLI_EXIT_FAIL 1
#define CLI_EXIT_USAGE 2
#define CLI_HELP_SHOWN (-1) /* cli_parse printed help: exit 0 */

typedef struct cli_global {
    const char *pg;                 /* conninfo; "" = PG* defaults */
    const char *amqp;               /* AMQP URL, or a comma-separated list of a cluster's nodes */
    const char *amqp_password_file; /* the AMQP password, one line; overrides the URL's */
    const char *exchange;           /* exchange name */
    idem_log_level level;
    idem_log_format format;
} cli_global_t;

typedef enum {
    OPT_FLAG,        /* bool *, no value */
    OPT_INT,         /* int *, within [min, max] */
    OPT_STRING,      /* const char ** */
    OPT_LIST,        /* cli_list_t *, repeatable */
    OPT_DURATION,    /* int64_t * milliseconds; units s m h d */
    OPT_DURATION_MS, /* int64_t * milliseconds; units ms s m h d */
} cli_opt_kind;

#define CLI_LIST_MAX 64
#define CLI_DURATION_MAX_MS (3650LL * 86400 * 1000) /* durations are capped at 10 years */
typedef struct cli_list {
    const char *items[CLI_LIST_MAX + 1]; /* NULL-terminated */
    int n;
} cli_list_t;

typedef struct cli_opt {
    const char *name; /* "--prefetch" */
    cli_opt_kind kind;
    void *dest;
    const char *metavar; /* "N", "DURATION" */
    const char *def;     /* default as shown in --help, NULL = none */
    const char *help;
    long min, max; /* OPT_INT bounds; durations: seconds (max 0 = CLI_DURATION_MAX_MS) */
} cli_opt_t;

/* Fills g from the environment and defaults. */
void cli_global_init(cli_global_t *g);

/* Flags the daemons share, as option table entries: the transaction timeouts and the metrics
 * endpoint. Arguments are the int64_t/int/const char * variables the values go to. */
#define CLI_OPTS_TIMEOUTS(lock_ms, statement_ms)                                                   \
    {"--lock-timeout",                                                                             \
     OPT_DURATION_MS,                                                                              \
     (lock_ms),                                                                                    \
     "DURATION",                                                                                   \
     "5s",                                                                                         \
     "lock_timeout of each transaction (0s = none)",                                               \
     0,                                                                                            \
     86400},                                                                                       \
    {                                                                                              \
        "--statement-timeout", OPT_DURATION_MS, (statement_ms), "DURATION", "30s",                 \
            "statement_timeout of each transaction (0s = none)", 0, 86400                          \
    }
#define CLI_OPT_HEARTBEAT(ms)                                                                      \
    {                                                                                              \
        "--heartbeat", OPT_DURATION, (ms), "DURATION", "30s",                                      \
            "AMQP heartbeat: a dead link is noticed within two (0s = off; the URL's heartbeat= "   \
            "applies when this is not given)",                                                     \
            0, 65535                                                                               \
    }
#define CLI_OPTS_METRICS(port, addr)                                                               \
    {"--metrics-port",                                                                             \
     OPT_INT,                                                                                      \
     (port),                                                                                       \
     "PORT",                                                                                       \
     "none",                                                                                       \
     "serve Prometheus metrics at /metrics",                                                       \
     1,                                                                                            \
     65535},                                                                                       \
    {                                                                                              \
        "--metrics-addr", OPT_STRING, (addr), "ADDR", "127.0.0.1",                                 \
            "listen address of the metrics endpoint", 0, 0                                         \
    }

/* Parses argv[1..argc) of command cmd against opts (terminated by a zero entry) and the global
 * flags. Returns 0, CLI_EXIT_USAGE (one line printed on stderr) or CLI_HELP_SHOWN. */
int cli_parse(const char *cmd, const char *synopsis, int argc, char **argv, const cli_opt_t *opts,
              cli_global_t *g);

/* The AMQP password from --amqp-password-file / IDEM_AMQP_PASSWORD_FILE into buf, or NULL when
 * none is set. A file that cannot be read: one line on stderr, *failed set. */
const char *cli_amqp_password(const cli_global_t *g, const char *cmd, char *buf, size_t sz,
                              bool *failed);
/* The password file at path into buf: 1 read, 0 no path, -1 refused or unreadable (why says
 * so, naming the file but never its contents). */
int cli_read_password(const char *path, char *buf, size_t sz, char *why, size_t whysz);
/* The daemons' reload_password (userdata: the cli_global_t): the file read again. */
int cli_reload_password(void *userdata, char *buf, size_t sz, idem_error_t *err);

/* One error line on stderr: "idem CMD: MESSAGE", or with --log-format json a JSON log line
 * (level error, component CMD). cli_usage_error adds "(see 'idem CMD --help')". */
void cli_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* --log-format json anywhere on the command line: the lines printed before the flags are
 * parsed (an unknown command, a bad flag) are JSON too. */
void cli_prescan_format(int argc, char **argv);

/* The first line of the secret file path (what names it in errors: "AMQP password") into buf;
 * NULL when path is NULL or "". A file that cannot be read, is empty, or that group or others may
 * access (group only when root owns it): one line on stderr, *failed set. */
const char *cli_secret_file(const char *path, const char *cmd, const char *what, char *buf,
                            size_t sz, bool *failed);
/* Applies g's log settings. */
void cli_apply_logging(const cli_global_t *g);

/* A usage error for cmd: prints "idem CMD: msg" and returns CLI_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Signal handling for daemons: the first SIGTERM/SIGINT sets cli_stop, a second exits at once. */
extern volatile sig_atomic_t cli_stop;
void cli_install_signals(void);
/* Daemons: SIGHUP sets cli_reload (the daemon's loop re-reads what it can; see reload in the
 * library's configs) instead of ending the process. */
extern volatile sig_atomic_t cli_reload;
void cli_install_reload(void);

/* Command entry points; each returns the process exit status. */
/* Connects for the one-shot command cmd and checks that the database is migrated to what this
 * binary needs. On failure prints the one contract line, returns NULL and sets *code: unreachable
 * when it cannot connect or query, CLI_EXIT_FAIL when the schema is not migrated. */
typedef struct pg_conn PGconn;
PGconn *cli_pg_connect(const char *cmd, const cli_global_t *g, int unreachable, int *code);

int cmd_migrate(int argc, char **argv, cli_global_t *g);
int cmd_consume(int argc, char **argv, cli_global_t *g);
int cmd_relay(int argc, char **argv, cli_global_t *g);
int cmd_emit(int argc, char **argv, cli_global_t *g);
int cmd_status(int argc, char **argv, cli_global_t *g);
int cmd_failed(int argc, char **argv, cli_global_t *g);
int cmd_replay(int argc, char **argv, cli_global_t *g);
int cmd_retain(int argc, char **argv, cli_global_t *g);
int cmd_dlq(int argc, char **argv, cli_global_t *g);
int cmd_console(int argc, char **argv, cli_global_t *g);

#endif
