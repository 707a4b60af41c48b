/* args.c - the CLI's flag parser. */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <idem/duration.h>
#include <idem/error.h>
#include <idem/log.h>

#include "args.h"
#include "pg.h"

volatile sig_atomic_t cli_stop;
volatile sig_atomic_t cli_reload;
/* The format of the lines this process prints on stderr: known once the flags are parsed (and
 * earlier when --log-format json is on the command line, see cli_prescan_format). */
static idem_log_format err_format = IDEM_LOG_TEXT;

static void on_signal(int sig)
{
    if (cli_stop)
        _exit(1);
    cli_stop = sig;
}

static void on_hangup(int sig)
{
    (void)sig;
    cli_reload = 1;
}

void cli_install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0; /* no SA_RESTART: blocking waits return early */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

void cli_install_reload(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_hangup;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;
    sigaction(SIGHUP, &sa, NULL);
}

static const char *env_or(const char *name, const char *def)
{
    const char *v = getenv(name);
    return v != NULL ? v : def;
}

void cli_global_init(cli_global_t *g)
{
    g->pg = env_or("IDEM_PG_URL", "");
    g->amqp = env_or("IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672");
    g->exchange = env_or("IDEM_EXCHANGE", "billing.events");
    g->amqp_password_file = env_or("IDEM_AMQP_PASSWORD_FILE", NULL);
    if (g->amqp[0] == '\0')
        g->amqp = "amqp://guest:guest@127.0.0.1:5672";
    if (g->exchange[0] == '\0')
        g->exchange = "billing.events";
    g->level = IDEM_LOG_INFO;
    g->format = err_format;
}

/* Reads a one-line secret (what: "AMQP password", "token") from path into buf: 1 read, 0 no
 * path, -1 with why set (unreadable, too open, empty or too long). */
static int read_secret(const char *path, const char *what, char *buf, size_t sz, char *why,
                       size_t whysz)
{
    if (path == NULL || path[0] == '\0')
        return 0;
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        snprintf(why, whysz, "cannot read the %s file %s: %s", what, path, strerror(errno));
        return -1;
    }
    /* as libpq for its key files: no access for others, and for the group only when root
     * owns the file (root:idem 0640, as the deployment kit installs it) */
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode) ||
        (st.st_mode & (st.st_uid == 0 ? 0037 : 0077)) != 0) {
        snprintf(why, whysz,
                 "the %s file %s is not a regular file, or group or others may access it (mode "
                 "%04o; chmod 600 it, or 640 owned by root)",
                 what, path, (unsigned)(st.st_mode & 07777));
        fclose(f);
        return -1;
    }
    bool ok = fgets(buf, (int)sz, f) != NULL;
    fclose(f);
    size_t n = ok ? strcspn(buf, "\r\n") : 0;
    if (!ok || n == 0 || n >= sz - 1) {
        memset(buf, 0, sz);
        snprintf(why, whysz, "the %s file %s is empty or its line is too long", what, path);
        return -1;
    }
    buf[n] = '\0';
    return 1;
}

int cli_read_password(const char *path, char *buf, size_t sz, char *why, size_t whysz)
{
    return read_secret(path, "AMQP password", buf, sz, why, whysz);
}

const char *cli_secret_file(const char *path, const char *cmd, const char *what, char *buf,
                            size_t sz, bool *failed)
{
    char why[600];
    int rc = read_secret(path, what, buf, sz, why, sizeof why);
    *failed = rc < 0;
    if (rc < 0)
        cli_error(cmd, "%s", why);
    return rc > 0 ? buf : NULL;
}

const char *cli_amqp_password(const cli_global_t *g, const char *cmd, char *buf, size_t sz,
                              bool *failed)
{
    return cli_secret_file(g->amqp_password_file, cmd, "AMQP password", buf, sz, failed);
}

int cli_reload_password(void *userdata, char *buf, size_t sz, idem_error_t *err)
{
    const cli_global_t *g = userdata;
    char why[600];
    int rc = cli_read_password(g->amqp_password_file, buf, sz, why, sizeof why);
    if (rc < 0)
        idem_error_set(err, IDEM_ERR_IO, "%s", why);
    return rc;
}

void cli_apply_logging(const cli_global_t *g)
{
    idem_log_set_level(g->level);
    idem_log_set_format(g->format);
    err_format = g->format;
}

void cli_prescan_format(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        if (strcmp(argv[i], "--log-format") == 0 && i + 1 < argc)
            v = argv[i + 1];
        else if (strncmp(argv[i], "--log-format=", 13) == 0)
            v = argv[i] + 13;
        if (v != NULL && strcmp(v, "json") == 0) {
            err_format = IDEM_LOG_JSON;
            idem_log_set_format(IDEM_LOG_JSON);
        }
    }
}

static void verror(const char *cmd, const char *suffix, const char *fmt, va_list ap)
{
    char msg[2048];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (err_format == IDEM_LOG_JSON) {
        idem_log(IDEM_LOG_ERROR, cmd != NULL ? cmd : "idem", NULL, "%s%s", msg, suffix);
    } else {
        fprintf(stderr, "idem%s%s: %s%s\n", cmd != NULL ? " " : "", cmd != NULL ? cmd : "", msg,
                suffix);
        fflush(stderr);
    }
}

void cli_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    verror(cmd, "", fmt, ap);
    va_end(ap);
}

int cli_usage_error(const char *cmd, const char *fmt, ...)
{
    char suffix[128];
    snprintf(suffix, sizeof suffix, " (see 'idem %s --help')", cmd);
    va_list ap;
    va_start(ap, fmt);
    verror(cmd, suffix, fmt, ap);
    va_end(ap);
    return CLI_EXIT_USAGE;
}

static const cli_opt_t global_help[] = {
    {"--pg", OPT_STRING, NULL, "CONNINFO", "$IDEM_PG_URL or PG* defaults",
     "PostgreSQL conninfo or URI", 0, 0},
    {"--amqp", OPT_STRING, NULL, "URL", "$IDEM_AMQP_URL or amqp://guest:guest@127.0.0.1:5672",
     "RabbitMQ URL", 0, 0},
    {"--exchange", OPT_STRING, NULL, "NAME", "$IDEM_EXCHANGE or billing.events", "topic exchange",
     0, 0},
    {"--amqp-password-file", OPT_STRING, NULL, "PATH", "$IDEM_AMQP_PASSWORD_FILE",
     "file whose first line is the RabbitMQ password (overrides the URL's)", 0, 0},
    {"--log-level", OPT_STRING, NULL, "LEVEL", "info", "debug|info|warn|error", 0, 0},
    {"--log-format", OPT_STRING, NULL, "FORMAT", "text", "text|json", 0, 0},
    {0},
};

static void print_opts(FILE *f, const cli_opt_t *opts)
{
    for (const cli_opt_t *o = opts; o->name != NULL; o++) {
        char left[64];
        snprintf(left, sizeof left, "%s%s%s", o->name, o->metavar ? " " : "",
                 o->metavar ? o->metavar : "");
        fprintf(f, "  %-28s %s", left, o->help);
        if (o->def != NULL)
            fprintf(f, " (default: %s)", o->def);
        fputc('\n', f);
    }
}

static void print_help(const char *cmd, const char *synopsis, const cli_opt_t *opts)
{
    printf("usage: idem [GLOBAL FLAGS] %s %s\n\n", cmd, synopsis);
    if (opts != NULL && opts->name != NULL) {
        printf("flags:\n");
        print_opts(stdout, opts);
        printf("\n");
    }
    printf("global flags (accepted before or after the command):\n");
    print_opts(stdout, global_help);
    printf("  %-28s %s\n", "--help", "show this help");
}

static int set_value(const char *cmd, const cli_opt_t *o, const char *val)
{
    switch (o->kind) {
    case OPT_FLAG:
        *(bool *)o->dest = true;
        return 0;
    case OPT_STRING:
        *(const char **)o->dest = val;
        return 0;
    case OPT_LIST: {
        cli_list_t *l = o->dest;
        if (l->n >= CLI_LIST_MAX)
            return cli_usage_error(cmd, "too many %s values (at most %d)", o->name, CLI_LIST_MAX);
        if (*val == '\0')
            return cli_usage_error(cmd, "%s needs a non-empty value", o->name);
        l->items[l->n++] = val;
        l->items[l->n] = NULL;
        return 0;
    }
    case OPT_INT: {
        char *end;
        errno = 0;
        long v = strtol(val, &end, 10);
        if (errno != 0 || end == val || *end != '\0' || v < o->min || v > o->max)
            return cli_usage_error(cmd, "%s: '%s' is not an integer in %ld..%ld", o->name, val,
                                   o->min, o->max);
        *(int *)o->dest = (int)v;
        return 0;
    }
    case OPT_DURATION:
    case OPT_DURATION_MS: {
        int64_t ms;
        if (idem_duration_parse(val, o->kind == OPT_DURATION_MS, &ms) != 0)
            return cli_usage_error(
                cmd, "%s: '%s' is not a duration (an integer with a unit: %s)", o->name, val,
                o->kind == OPT_DURATION_MS ? "ms, s, m, h or d" : "s, m, h or d");
        /* a cap keeps every later sum of times and durations far from overflowing */
        int64_t max = o->max > 0 ? (int64_t)o->max * 1000 : CLI_DURATION_MAX_MS;
        if (ms < (int64_t)o->min * 1000 || ms > max)
            return cli_usage_error(cmd, "%s: '%s' is out of range", o->name, val);
        *(int64_t *)o->dest = ms;
        return 0;
    }
    }
    return 0;
}

/* Splits "--name=value"; returns the option matching name in opts or NULL. */
static const cli_opt_t *find_opt(const cli_opt_t *opts, const char *arg, size_t namelen)
{
    for (const cli_opt_t *o = opts; o != NULL && o->name != NULL; o++)
        if (strlen(o->name) == namelen && strncmp(o->name, arg, namelen) == 0)
            return o;
    return NULL;
}

int cli_parse(const char *cmd, const char *synopsis, int argc, char **argv, const cli_opt_t *opts,
              cli_global_t *g)
{
    const char *level = NULL, *format = NULL;
    const cli_opt_t globals[] = {
        {"--pg", OPT_STRING, &g->pg, NULL, NULL, NULL, 0, 0},
        {"--amqp", OPT_STRING, &g->amqp, NULL, NULL, NULL, 0, 0},
        {"--exchange", OPT_STRING, &g->exchange, NULL, NULL, NULL, 0, 0},
        {"--amqp-password-file", OPT_STRING, &g->amqp_password_file, NULL, NULL, NULL, 0, 0},
        {"--log-level", OPT_STRING, &level, NULL, NULL, NULL, 0, 0},
        {"--log-format", OPT_STRING, &format, NULL, NULL, NULL, 0, 0},
        {0},
    };
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            print_help(cmd, synopsis, opts);
            return CLI_HELP_SHOWN;
        }
        if (strncmp(arg, "--", 2) != 0)
            return cli_usage_error(cmd, "unexpected argument '%s'", arg);
        const char *eq = strchr(arg, '=');
        size_t namelen = eq ? (size_t)(eq - arg) : strlen(arg);
        const cli_opt_t *o = find_opt(opts, arg, namelen);
        if (o == NULL)
            o = find_opt(globals, arg, namelen);
        if (o == NULL)
            return cli_usage_error(cmd, "unknown flag '%.*s'", (int)namelen, arg);
        const char *val = NULL;
        if (o->kind == OPT_FLAG) {
            if (eq != NULL)
                return cli_usage_error(cmd, "%s takes no value", o->name);
        } else if (eq != NULL) {
            val = eq + 1;
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            return cli_usage_error(cmd, "%s needs a value", o->name);
        }
        int rc = set_value(cmd, o, val);
        if (rc != 0)
            return rc;
    }
    if (level != NULL && idem_log_parse_level(level, &g->level) != IDEM_OK)
        return cli_usage_error(cmd, "--log-level: '%s' is not one of debug, info, warn, error",
                               level);
    if (format != NULL && idem_log_parse_format(format, &g->format) != IDEM_OK)
        return cli_usage_error(cmd, "--log-format: '%s' is not text or json", format);
    if (g->exchange == NULL || g->exchange[0] == '\0')
        return cli_usage_error(cmd, "--exchange needs a non-empty name");
    cli_apply_logging(g);
    return 0;
}

PGconn *cli_pg_connect(const char *cmd, const cli_global_t *g, int unreachable, int *code)
{
    idem_error_t err = {0};
    PGconn *conn = idemp_pg_connect_once(g->pg, &err);
    *code = unreachable;
    if (conn != NULL && idemp_pg_schema_check(conn, NULL, &err) != IDEM_OK) {
        if (err.code == IDEM_ERR_NOT_FOUND || err.code == IDEM_ERR_REFUSED)
            *code = CLI_EXIT_FAIL;
        idemp_pgconn_close(conn);
        conn = NULL;
    }
    if (conn == NULL)
        fprintf(stderr, "idem %s: %s\n", cmd, err.text);
    return conn;
}
