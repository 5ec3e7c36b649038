/* A RESP client on libhiredis (the C library many Redis clients sit on), run by test_resp.py
 * against sparsekvd's Redis listener (or a redis-server, to check the test itself).
 *
 *   resp_hiredis_client HOST PORT [NAMESPACE TOKEN]
 *
 * Checks: binary SET/GET with %b (bytes 0..255, "\r\n" and NUL inside), 1000 commands pipelined
 * with redisAppendCommand then read with redisGetReply, MGET with a missing key, DEL's count, an
 * unknown command answered with REDIS_REPLY_ERROR (the connection still usable after it), and a
 * 1 MiB value's round trip. Prints "ok N" (N: the checks passed) and exits 0; on the first failed
 * check prints what failed and exits 1. Works with hiredis 0.14 and 1.x. */

#include <hiredis/hiredis.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_checks = 0;

static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL: ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  exit(1);
}

static void check(int cond, const char *what) {
  if (!cond) fail("%s", what);
  ++g_checks;
}

static const char *type_name(int type) {
  switch (type) {
    case REDIS_REPLY_STRING: return "string";
    case REDIS_REPLY_ARRAY: return "array";
    case REDIS_REPLY_INTEGER: return "integer";
    case REDIS_REPLY_NIL: return "nil";
    case REDIS_REPLY_STATUS: return "status";
    case REDIS_REPLY_ERROR: return "error";
    default: return "other";
  }
}

/* The reply of a command that must not fail at the connection level. */
static redisReply *must(redisContext *c, redisReply *r, const char *what) {
  if (r == NULL) fail("%s: no reply (connection error %d: %s)", what, c->err, c->errstr);
  return r;
}

static void expect_status(redisContext *c, redisReply *r, const char *status, const char *what) {
  must(c, r, what);
  if (r->type != REDIS_REPLY_STATUS || strcmp(r->str, status) != 0)
    fail("%s: expected +%s, got %s '%s'", what, status, type_name(r->type),
         r->str ? r->str : "");
  ++g_checks;
  freeReplyObject(r);
}

static void expect_integer(redisContext *c, redisReply *r, long long v, const char *what) {
  must(c, r, what);
  if (r->type != REDIS_REPLY_INTEGER || r->integer != v)
    fail("%s: expected :%lld, got %s %lld '%s'", what, v, type_name(r->type), r->integer,
         r->str ? r->str : "");
  ++g_checks;
  freeReplyObject(r);
}

static void expect_bulk(redisContext *c, redisReply *r, const char *v, size_t len,
                        const char *what) {
  must(c, r, what);
  if (r->type != REDIS_REPLY_STRING)
    fail("%s: expected a bulk string of %zu bytes, got %s '%s'", what, len, type_name(r->type),
         r->str ? r->str : "");
  if ((size_t)r->len != len || memcmp(r->str, v, len) != 0)
    fail("%s: expected %zu bytes, got %zu bytes that differ", what, len, (size_t)r->len);
  ++g_checks;
  freeReplyObject(r);
}

int main(int argc, char **argv) {
  if (argc != 3 && argc != 5) {
    fprintf(stderr, "usage: %s HOST PORT [NAMESPACE TOKEN]\n", argv[0]);
    return 2;
  }
  struct timeval timeout = {30, 0};
  redisContext *c = redisConnectWithTimeout(argv[1], atoi(argv[2]), timeout);
  if (c == NULL || c->err) fail("connect: %s", c ? c->errstr : "out of memory");
  redisSetTimeout(c, timeout);

  if (argc == 5) {
    expect_status(c, redisCommand(c, "AUTH %s %s", argv[3], argv[4]), "OK", "AUTH");
  }
  expect_status(c, redisCommand(c, "PING"), "PONG", "PING");

  /* A key made unique per run so that reruns against one server start clean. */
  char prefix[64];
  snprintf(prefix, sizeof prefix, "hiredis:%ld:", (long)getpid());
  char key[128];

  /* Binary: every byte value, CR LF and NUL in both key and value. */
  char bkey[64];
  size_t bkey_len = (size_t)snprintf(bkey, sizeof bkey, "%sbin", prefix);
  memcpy(bkey + bkey_len, "\r\n\0x", 4);
  bkey_len += 4;
  char bval[1024];
  for (size_t i = 0; i < sizeof bval; ++i) bval[i] = (char)(i * 7 + 13);
  memcpy(bval + 100, "\r\n\0\r\n", 5);
  expect_status(c, redisCommand(c, "SET %b %b", bkey, bkey_len, bval, sizeof bval), "OK",
                "SET binary");
  expect_bulk(c, redisCommand(c, "GET %b", bkey, bkey_len), bval, sizeof bval, "GET binary");
  expect_integer(c, redisCommand(c, "STRLEN %b", bkey, bkey_len), (long long)sizeof bval,
                 "STRLEN binary");
  /* An empty value is a value, not a missing key. */
  snprintf(key, sizeof key, "%sempty", prefix);
  expect_status(c, redisCommand(c, "SET %s %b", key, "", (size_t)0), "OK", "SET empty");
  expect_bulk(c, redisCommand(c, "GET %s", key), "", 0, "GET empty");

  /* 1000 SETs then 1000 GETs, appended without waiting, then read in order. */
  enum { kPipelined = 1000 };
  for (int i = 0; i < kPipelined; ++i) {
    char v[64];
    int vn = snprintf(v, sizeof v, "value-%d", i * 31);
    snprintf(key, sizeof key, "%sp%d", prefix, i);
    if (redisAppendCommand(c, "SET %s %b", key, v, (size_t)vn) != REDIS_OK)
      fail("redisAppendCommand SET %d: %s", i, c->errstr);
  }
  for (int i = 0; i < kPipelined; ++i) {
    snprintf(key, sizeof key, "%sp%d", prefix, i);
    if (redisAppendCommand(c, "GET %s", key) != REDIS_OK)
      fail("redisAppendCommand GET %d: %s", i, c->errstr);
  }
  for (int i = 0; i < kPipelined; ++i) {
    void *reply = NULL;
    if (redisGetReply(c, &reply) != REDIS_OK) fail("redisGetReply SET %d: %s", i, c->errstr);
    redisReply *r = reply;
    if (r->type != REDIS_REPLY_STATUS || strcmp(r->str, "OK") != 0)
      fail("pipelined SET %d: got %s '%s'", i, type_name(r->type), r->str ? r->str : "");
    freeReplyObject(r);
  }
  ++g_checks;
  for (int i = 0; i < kPipelined; ++i) {
    void *reply = NULL;
    if (redisGetReply(c, &reply) != REDIS_OK) fail("redisGetReply GET %d: %s", i, c->errstr);
    redisReply *r = reply;
    char v[64];
    int vn = snprintf(v, sizeof v, "value-%d", i * 31);
    if (r->type != REDIS_REPLY_STRING || (size_t)r->len != (size_t)vn || memcmp(r->str, v, (size_t)vn) != 0)
      fail("pipelined GET %d: expected '%s', got %s '%.*s'", i, v, type_name(r->type),
           r->str ? (int)r->len : 0, r->str ? r->str : "");
    freeReplyObject(r);
  }
  ++g_checks;

  /* MGET: present, missing, present. */
  {
    char k0[128], k1[128], k2[128];
    snprintf(k0, sizeof k0, "%sp0", prefix);
    snprintf(k1, sizeof k1, "%smissing", prefix);
    snprintf(k2, sizeof k2, "%sp999", prefix);
    redisReply *r = must(c, redisCommand(c, "MGET %s %s %s", k0, k1, k2), "MGET");
    check(r->type == REDIS_REPLY_ARRAY && r->elements == 3, "MGET: an array of 3");
    check(r->element[0]->type == REDIS_REPLY_STRING && r->element[0]->len == 7 &&
              memcmp(r->element[0]->str, "value-0", 7) == 0,
          "MGET[0] == value-0");
    check(r->element[1]->type == REDIS_REPLY_NIL, "MGET[1] is nil");
    check(r->element[2]->type == REDIS_REPLY_STRING && r->element[2]->len == 11 &&
              memcmp(r->element[2]->str, "value-30969", 11) == 0,
          "MGET[2] == value-30969");
    freeReplyObject(r);
  }

  /* DEL counts the keys it removed: two present, one missing, a duplicate. */
  {
    char k0[128], k1[128], k2[128];
    snprintf(k0, sizeof k0, "%sp1", prefix);
    snprintf(k1, sizeof k1, "%sp2", prefix);
    snprintf(k2, sizeof k2, "%smissing", prefix);
    expect_integer(c, redisCommand(c, "DEL %s %s %s %s", k0, k1, k2, k0), 2, "DEL count");
    redisReply *r = must(c, redisCommand(c, "GET %s", k0), "GET deleted");
    check(r->type == REDIS_REPLY_NIL, "GET of a deleted key is nil");
    freeReplyObject(r);
  }

  /* An unknown command is an error reply, and the connection goes on. */
  {
    redisReply *r = must(c, redisCommand(c, "NOSUCHCOMMAND %s", "arg"), "unknown command");
    check(r->type == REDIS_REPLY_ERROR, "unknown command: REDIS_REPLY_ERROR");
    check(strncmp(r->str, "ERR unknown command", 19) == 0, "unknown command: 'ERR unknown command'");
    freeReplyObject(r);
    expect_status(c, redisCommand(c, "PING"), "PONG", "PING after an error");
  }

  /* A 1 MiB value. */
  {
    size_t n = 1u << 20;
    char *big = malloc(n);
    if (big == NULL) fail("malloc");
    unsigned x = 2463534242u;
    for (size_t i = 0; i < n; ++i) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      big[i] = (char)x;
    }
    snprintf(key, sizeof key, "%sbig", prefix);
    expect_status(c, redisCommand(c, "SET %s %b", key, big, n), "OK", "SET 1 MiB");
    expect_bulk(c, redisCommand(c, "GET %s", key), big, n, "GET 1 MiB");
    expect_integer(c, redisCommand(c, "DEL %s", key), 1, "DEL 1 MiB");
    free(big);
  }

  /* Clean up the pipelined keys (their count, less the two deleted above). */
  {
    const char **argvv = malloc(sizeof(char *) * (kPipelined + 1));
    size_t *lens = malloc(sizeof(size_t) * (kPipelined + 1));
    char(*keys)[128] = malloc(sizeof(*keys) * kPipelined);
    if (!argvv || !lens || !keys) fail("malloc");
    argvv[0] = "DEL";
    lens[0] = 3;
    for (int i = 0; i < kPipelined; ++i) {
      snprintf(keys[i], sizeof keys[i], "%sp%d", prefix, i);
      argvv[i + 1] = keys[i];
      lens[i + 1] = strlen(keys[i]);
    }
    expect_integer(c, redisCommandArgv(c, kPipelined + 1, argvv, lens), kPipelined - 2,
                   "DEL of the pipelined keys");
    free(keys);
    free(lens);
    free(argvv);
  }

  redisFree(c);
  printf("ok %d\n", g_checks);
  return 0;
}
