/* rmq_socket.c - the socket under a RabbitMQ connection: TLS set up from the URL's parameters
 * (verification on unless verify=verify_none), and the reasons a connect failed, which
 * librabbitmq 0.11 reports only as "a socket error occurred" or "a SSL error occurred". */
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <amqp_ssl_socket.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>

#include "rmq_int.h"

/* librabbitmq's non-blocking connect reports only "a socket error occurred"; after a failure a
 * plain connect tells the operator why (refused, unreachable, unknown host). */
void idemp_amqp_tcp_reason(const char *host, int port, int amqp_rc, char *out, size_t sz)
{
    snprintf(out, sz, "%s", amqp_error_string2(amqp_rc));
    if (amqp_rc != AMQP_STATUS_SOCKET_ERROR && amqp_rc != AMQP_STATUS_HOSTNAME_RESOLUTION_FAILED)
        return;
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    int g = getaddrinfo(host, portstr, &hints, &ai);
    if (g != 0) {
        snprintf(out, sz, "cannot resolve host: %s", gai_strerror(g));
        return;
    }
    int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd >= 0) {
        struct timeval tv = {2, 0};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0)
            snprintf(out, sz, "%s", strerror(errno));
        close(fd);
    }
    freeaddrinfo(ai);
}

/* Why a TLS handshake failed, for the error line: librabbitmq 0.11 only says "SSL peer cert
 * verification failed" or "a SSL error occurred". The first certificate error of the handshake
 * (the callback runs in librabbitmq's SSL_VERIFY_NONE mode too, and changes nothing), else
 * OpenSSL's last error, e.g. the server's "certificate required" alert. */
static _Thread_local int tls_verify_error;

static int remember_verify_error(int ok, X509_STORE_CTX *x)
{
    if (!ok && tls_verify_error == 0)
        tls_verify_error = X509_STORE_CTX_get_error(x);
    return ok;
}

void idemp_amqp_tls_detail(const idemp_amqp_url_t *u, bool after_handshake, char *out, size_t sz)
{
    if (!u->tls)
        return;
    size_t n = strlen(out);
    unsigned long e = ERR_peek_last_error();
    if (tls_verify_error != 0)
        snprintf(out + n, sz - n, ": %s", X509_verify_cert_error_string(tls_verify_error));
    else if (e != 0 && ERR_reason_error_string(e) != NULL)
        snprintf(out + n, sz - n, ": %s", ERR_reason_error_string(e));
    else if (after_handshake && u->certfile[0] == '\0')
        /* TLS 1.3: the broker's "certificate required" alert may arrive as a reset */
        snprintf(out + n, sz - n,
                 ": the broker closed the TLS link (does it require a client certificate? "
                 "certfile=, keyfile=)");
}

/* A TLS socket per the URL's parameters; verification is on unless verify=verify_none. */
amqp_socket_t *idemp_amqp_tls_socket(amqp_connection_state_t conn, const idemp_amqp_url_t *u,
                                     char *why, size_t whysz)
{
    amqp_socket_t *sock = amqp_ssl_socket_new(conn);
    if (sock == NULL) {
        snprintf(why, whysz, "cannot set up TLS");
        return NULL;
    }
    SSL_CTX *ctx = amqp_ssl_socket_get_context(sock);
    if (u->cacertfile[0] != '\0') {
        if (amqp_ssl_socket_set_cacert(sock, u->cacertfile) != AMQP_STATUS_OK) {
            snprintf(why, whysz, "cannot read cacertfile %s", u->cacertfile);
            return NULL;
        }
    } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
        snprintf(why, whysz, "cannot load the system CA certificates");
        return NULL;
    }
    if (u->certfile[0] != '\0' || u->keyfile[0] != '\0') {
        if (amqp_ssl_socket_set_key(sock, u->certfile, u->keyfile) != AMQP_STATUS_OK) {
            snprintf(why, whysz, "cannot read certfile %s / keyfile %s", u->certfile, u->keyfile);
            return NULL;
        }
    }
    tls_verify_error = 0;
    ERR_clear_error();
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, remember_verify_error);
    amqp_ssl_socket_set_verify_peer(sock, u->verify_peer);
    if (u->verify_peer && u->sni[0] != '\0') {
        /* verify the certificate against the given name instead of the host we dial */
        amqp_ssl_socket_set_verify_hostname(sock, 0);
        X509_VERIFY_PARAM_set1_host(SSL_CTX_get0_param(ctx), u->sni, 0);
    } else {
        amqp_ssl_socket_set_verify_hostname(sock, u->verify_peer);
    }
    return sock;
}
