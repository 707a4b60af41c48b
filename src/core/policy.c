/* policy.c - the failure policy of the consumer (see the contract's "Failure policy"). */
#include <string.h>

#include "policy.h"

static bool in(const char *s, const char *const *set, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(s, set[i]) == 0)
            return true;
    return false;
}

static bool transient(const char *s)
{
    static const char *const retry[] = {"40001", "40P01", "55P03", "57014"};
    return in(s, retry, sizeof retry / sizeof retry[0]);
}

idemp_policy idemp_policy_for_handler(const char *sqlstate)
{
    if (sqlstate == NULL || strlen(sqlstate) != 5)
        return IDEMP_POLICY_PAUSE;
    if (transient(sqlstate))
        return IDEMP_POLICY_RETRY;
    /* bad data, a constraint, the handler ending the transaction (2D), its own PL/pgSQL
     * (P0001 RAISE, P0002/P0003 SELECT ... INTO STRICT, P0004 ASSERT) */
    if (strncmp(sqlstate, "22", 2) == 0 || strncmp(sqlstate, "23", 2) == 0 ||
        strncmp(sqlstate, "2D", 2) == 0 || strncmp(sqlstate, "P0", 2) == 0)
        return IDEMP_POLICY_REJECT;
    return IDEMP_POLICY_PAUSE;
}

idemp_policy idemp_policy_for_commit(const char *sqlstate)
{
    if (sqlstate == NULL || strlen(sqlstate) != 5)
        return IDEMP_POLICY_PAUSE;
    if (strcmp(sqlstate, "40001") == 0 || strcmp(sqlstate, "40P01") == 0)
        return IDEMP_POLICY_RETRY;
    /* a deferred constraint; or idem_claim_commit found the handler ended the claim's
     * transaction or changed a setting the runtime relies on (sql/008_claim_guard.sql) */
    if (strncmp(sqlstate, "23", 2) == 0 || strcmp(sqlstate, "IDEM2") == 0)
        return IDEMP_POLICY_REJECT;
    return IDEMP_POLICY_PAUSE;
}

const char *idemp_policy_name(idemp_policy p)
{
    switch (p) {
    case IDEMP_POLICY_RETRY:
        return "retry";
    case IDEMP_POLICY_REJECT:
        return "reject";
    case IDEMP_POLICY_PAUSE:
        return "pause";
    }
    return "?";
}
