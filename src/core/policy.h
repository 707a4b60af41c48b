/* policy.h - the failure policy: what a failed statement means for the delivery that ran it.
 * Pure functions over SQLSTATEs, shared by the consumer and its unit tests. */
#ifndef IDEM_POLICY_H
#define IDEM_POLICY_H

#include <stdbool.h>

typedef enum {
    IDEMP_POLICY_RETRY,  /* transient: spend a try, wait, try again (then retries_exhausted) */
    IDEMP_POLICY_REJECT, /* the event itself is at fault: dead-letter as handler_rejected */
    IDEMP_POLICY_PAUSE,  /* the environment is at fault: spend nothing, back off, redo */
} idemp_policy;

/* A handler's statement failed with sqlstate ("" or NULL: the connection was lost).
 * Retry: 40001, 40P01, 55P03, 57014. Reject: class 22, class 23, class 2D (the handler ended the
 * transaction), class P0 (PL/pgSQL: RAISE, INTO STRICT, ASSERT). Pause: the rest. */
idemp_policy idemp_policy_for_handler(const char *sqlstate);

/* COMMIT (or idem_claim_commit right before it) failed with sqlstate: serialization and deadlock
 * retry; a deferred constraint (class 23) rejects like the handler's own statement would have, and
 * so does IDEM2 (a handler ended the claim's transaction or changed a setting the runtime relies
 * on); anything else pauses. */
idemp_policy idemp_policy_for_commit(const char *sqlstate);

const char *idemp_policy_name(idemp_policy p); /* "retry", "reject", "pause" */

#endif
