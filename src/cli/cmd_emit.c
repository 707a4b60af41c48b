/* cmd_emit.c - `idem emit`: one event through idem_emit in its own transaction. */
#include <stdio.h>

#include <idem/idem.h>

#include "args.h"
#include "pg.h"

int cmd_emit(int argc, char **argv, cli_global_t *g)
{
    const char *type = NULL, *sub = NULL, *key = NULL, *payload = NULL, *headers = NULL;
    const cli_opt_t opts[] = {
        {"--type", OPT_STRING, &type, "TYPE", NULL, "event type (required)", 0, 0},
        {"--subscription", OPT_STRING, &sub, "UUID", NULL, "subscription id (required)", 0, 0},
        {"--key", OPT_STRING, &key, "DEDUP_KEY", NULL,
         "dedup key; the event id is md5(key)::uuid (required)", 0, 0},
        {"--payload", OPT_STRING, &payload, "JSON", NULL, "JSON object (required)", 0, 0},
        {"--headers", OPT_STRING, &headers, "JSON", NULL,
         "message headers, a JSON object of strings (e.g. {\"traceparent\": \"...\"})", 0, 0},
        {0},
    };
    int rc = cli_parse("emit",
                       "--type TYPE --subscription UUID --key DEDUP_KEY --payload JSON "
                       "[--headers JSON]",
                       argc, argv, opts, g);
    if (rc != 0)
        return rc == CLI_HELP_SHOWN ? CLI_EXIT_OK : rc;
    if (type == NULL || *type == '\0')
        return cli_usage_error("emit", "--type TYPE is required");
    if (sub == NULL)
        return cli_usage_error("emit", "--subscription UUID is required");
    char sub_norm[37];
    if (!idem_uuid_normalize(sub, sub_norm))
        return cli_usage_error("emit", "--subscription: '%s' is not a UUID", sub);
    if (key == NULL || *key == '\0')
        return cli_usage_error("emit", "--key DEDUP_KEY is required");
    if (payload == NULL)
        return cli_usage_error("emit", "--payload JSON is required");
    json_error_t jerr;
    json_t *doc = json_loads(payload, 0, &jerr);
    if (doc == NULL || !json_is_object(doc)) {
        json_decref(doc);
        return cli_usage_error("emit", "--payload must be a JSON object");
    }

    json_t *hdr = NULL;
    if (headers != NULL) {
        hdr = json_loads(headers, 0, &jerr);
        if (hdr == NULL || !json_is_object(hdr)) {
            json_decref(doc);
            json_decref(hdr);
            return cli_usage_error("emit", "--headers must be a JSON object");
        }
    }

    idem_error_t err = {0};
    PGconn *conn = cli_pg_connect("emit", g, CLI_EXIT_FAIL, &rc);
    if (conn == NULL) {
        json_decref(doc);
        json_decref(hdr);
        return rc;
    }
    char id[IDEM_UUID_LEN + 1];
    rc = idemp_pgconn_exec(conn, "BEGIN", 0, NULL, NULL, &err);
    if (rc == IDEM_OK)
        rc = idem_emit_with_headers(conn, type, sub_norm, key, doc, hdr, id, &err);
    if (rc == IDEM_OK)
        rc = idemp_pgconn_exec(conn, "COMMIT", 0, NULL, NULL, &err);
    json_decref(doc);
    json_decref(hdr);
    idemp_pgconn_close(conn);
    if (rc != IDEM_OK) {
        fprintf(stderr, "idem emit: %s\n", err.text);
        return CLI_EXIT_FAIL;
    }
    printf("%s\n", id);
    return CLI_EXIT_OK;
}
